"""make_tiny_model writes a real HF checkpoint: config, safetensors, and a character-level tokenizer."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from slime_spec.tiny_model import EOS_ID, full_vocab_size, main, make_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mimo"])
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
