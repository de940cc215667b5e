"""make_tiny_model writes a real HF checkpoint: config, safetensors, and a character-level tokenizer."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from slime_spec.tools.tiny_model import EOS_ID, full_vocab_size, main, make_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mimo", "deepseek_v3", "glm4_moe",
                                  "glm4_moe_lite"])
def test_tokenizer_round_trip_via_autotokenizer(tmp_path, arch):
    path = make_tiny_model(tmp_path / arch, arch=arch)
    tok = AutoTokenizer.from_pretrained(path)
    text = "Hello, world!\n  The answer is 42; (x-y) ~ {z}."
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, no bos added
    assert tok.decode(ids) == text
    assert len(tok) == full_vocab_size()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, EOS_ID)
    assert tok.decode(ids + [EOS_ID], skip_special_tokens=True) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok("<|im_end|>")["input_ids"] == [4]


def test_config_and_weights_are_hf_shaped(tmp_path):
    path = make_tiny_model(tmp_path / "m", arch="mimo", mtp_layers=2, hidden_size=32, num_layers=1)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["MiMoForCausalLM"] and config["model_type"] == "mimo"
    assert config["num_nextn_predict_layers"] == 2 and config["vocab_size"] == full_vocab_size()
    weights = load_file(str(path / "model.safetensors"))
    assert weights["model.mtp_layers.1.input_proj.weight"].shape == (32, 64)
    assert "model.mtp_layers.0.self_attn.q_proj.bias" in weights
    assert "lm_head.weight" in weights  # mimo is untied
    qwen = load_file(str(make_tiny_model(tmp_path / "q", arch="qwen2") / "model.safetensors"))
    assert "lm_head.weight" not in qwen  # qwen2 ties embeddings, as HF checkpoints do


def test_deterministic_by_seed_and_init_from(tmp_path):
    a = load_file(str(make_tiny_model(tmp_path / "a", seed=3) / "model.safetensors"))
    b = load_file(str(make_tiny_model(tmp_path / "b", seed=3) / "model.safetensors"))
    c = load_file(str(make_tiny_model(tmp_path / "c", seed=4) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    draft = load_file(str(make_tiny_model(tmp_path / "d", num_layers=1, seed=9, init_from=str(tmp_path / "a"))
                          / "model.safetensors"))
    assert torch.equal(draft["model.embed_tokens.weight"], a["model.embed_tokens.weight"])
    assert torch.equal(draft["model.layers.0.mlp.up_proj.weight"], a["model.layers.0.mlp.up_proj.weight"])
    assert "model.layers.1.mlp.up_proj.weight" not in draft


def test_small_vocab_and_bad_input(tmp_path):
    path = make_tiny_model(tmp_path / "s", vocab_size=16)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 16 and tok.decode(tok("a b")["input_ids"]) == "a b"
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_model(tmp_path / "x", vocab_size=4)
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path / "x", arch="gpt2")


def test_cli(tmp_path, capsys):
    assert main(["--arch", "qwen2", "--vocab", "64", "--hidden-size", "32", "--out", str(tmp_path / "cli")]) == 0
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["vocab_size"] == 64 and config["hidden_size"] == 32
    assert (tmp_path / "cli" / "tokenizer.json").exists()


# Keys the released DeepSeek-V3 and GLM-4.5 config.json files carry (SGLang's model classes and megatron-core read
# them), and each one's MTP layer as `model.layers.{num_hidden_layers}` with its own embedding and head copies.
DEEPSEEK_V3_KEYS = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                    "moe_intermediate_size", "n_group", "topk_group", "routed_scaling_factor", "scoring_func",
                    "topk_method", "norm_topk_prob", "num_nextn_predict_layers", "rope_scaling", "moe_layer_freq"}
GLM4_MOE_KEYS = {"head_dim", "partial_rotary_factor", "use_qk_norm", "attention_bias", "n_routed_experts",
                 "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace", "moe_intermediate_size",
                 "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "num_nextn_predict_layers",
                 "rope_scaling"}
# GLM-4.7-Flash's: every key of its release's config.json (tests/data/slime_checkpoints/GLM-4.7-Flash)
GLM4_MOE_LITE_KEYS = set(json.loads((Path(__file__).parent / "data" / "slime_checkpoints" / "GLM-4.7-Flash" /
                                     "config.json").read_text()))
MTP_OWN = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
           "shared_head.head.weight")


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "glm4_moe_lite"])
def test_deepseek_glm_checkpoints_have_the_released_layout(tmp_path, arch):
    from transformers import AutoConfig

    path = make_tiny_model(tmp_path / arch, arch=arch, dtype="bfloat16", num_layers=3, first_k_dense_replace=1)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch
    released = {"deepseek_v3": DEEPSEEK_V3_KEYS, "glm4_moe": GLM4_MOE_KEYS, "glm4_moe_lite": GLM4_MOE_LITE_KEYS}[arch]
    assert set(released) <= set(config)
    assert config["num_nextn_predict_layers"] == 1 and config["tie_word_embeddings"] is False
    assert type(AutoConfig.from_pretrained(path)).__name__ == {"deepseek_v3": "DeepseekV3Config",
                                                                 "glm4_moe": "Glm4MoeConfig",
                                                                 "glm4_moe_lite": "Glm4MoeLiteConfig"}[arch]
    w = load_file(str(path / "model.safetensors"))
    h, e = config["hidden_size"], config["n_routed_experts"]
    assert "model.layers.0.mlp.gate_proj.weight" in w and "model.layers.0.mlp.gate.weight" not in w  # dense first
    for layer in (1, 2, 3):  # sparse, then the MTP layer (sparse too)
        p = f"model.layers.{layer}.mlp."
        assert w[p + "gate.weight"].shape == (e, h)
        assert w[p + "gate.e_score_correction_bias"].dtype == torch.float32  # as the released files store it
        assert w[p + f"experts.{e - 1}.down_proj.weight"].shape == (h, config["moe_intermediate_size"])
        assert p + "shared_experts.up_proj.weight" in w
    assert all(f"model.layers.3.{n}" in w for n in MTP_OWN) and "model.layers.4.enorm.weight" not in w
    assert torch.equal(w["model.layers.3.embed_tokens.weight"], w["model.embed_tokens.weight"])
    assert torch.equal(w["model.layers.3.shared_head.head.weight"], w["lm_head.weight"])
    a = "model.layers.0.self_attn."
    if arch in ("deepseek_v3", "glm4_moe_lite"):
        heads, nope, rope = config["num_attention_heads"], config["qk_nope_head_dim"], config["qk_rope_head_dim"]
        assert config["rope_scaling"]["type"] == "yarn" if arch == "deepseek_v3" else config["rope_scaling"] is None
        assert w[a + "q_a_proj.weight"].shape == (config["q_lora_rank"], h)
        assert w[a + "q_b_proj.weight"].shape == (heads * (nope + rope), config["q_lora_rank"])
        assert w[a + "kv_a_proj_with_mqa.weight"].shape == (config["kv_lora_rank"] + rope, h)
        assert w[a + "kv_b_proj.weight"].shape == (heads * (nope + config["v_head_dim"]), config["kv_lora_rank"])
        assert a + "q_proj.weight" not in w
    else:
        assert config["rope_scaling"] is None and config["use_qk_norm"] is False
        assert w[a + "q_proj.bias"].shape == (config["num_attention_heads"] * config["head_dim"],)
        assert a + "q_norm.weight" not in w


def test_deepseek_glm_bad_input(tmp_path):
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        make_tiny_model(tmp_path / "x", arch="glm4_moe", num_layers=2, first_k_dense_replace=2)
    with pytest.raises(ValueError, match="num_experts=3"):
        make_tiny_model(tmp_path / "x", arch="deepseek_v3", num_experts=3)
    assert main(["--arch", "deepseek_v3", "--mtp-layers", "0", "--out", str(tmp_path / "no_mtp")]) == 0
    assert not any(".layers.2." in n for n in load_file(str(tmp_path / "no_mtp" / "model.safetensors")))
