"""The Megatron policy built from an HF config computes what the HF model computes (float32)."""

from __future__ import annotations

import pytest
import torch

from slime_spec.config import TrainConfig
from slime_spec.tiny_model import make_tiny_model
from slime_spec.trainer import cpu_compat, parallel
from slime_spec.trainer import model as M

ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def megatron():
    parallel.init_single_process(seed=0)


def build(path, **train_kwargs):
    hf_config, hf_state = M.read_hf_config(path), M.read_hf_state(path)
    train = TrainConfig(hf_checkpoint=str(path), **train_kwargs)
    model = M.build_gpt_model(hf_config, train)
    M.load_hf_weights(model, hf_state, hf_config, tp_rank=0, tp_size=1)
    return model.eval(), hf_config, hf_state


def hf_model(hf_config: dict, hf_state: dict, num_layers: int | None = None):
    """transformers' Llama/Qwen2 (MiMo's trunk is a Qwen2) with the checkpoint's trunk weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    fields = {k: v for k, v in hf_config.items() if k not in ("num_nextn_predict_layers", "architectures")}
    if num_layers is not None:
        fields.update(num_hidden_layers=num_layers, max_window_layers=num_layers)
    if hf_config["model_type"] == "llama":
        model = LlamaForCausalLM(LlamaConfig(**fields))
    else:
        fields["model_type"] = "qwen2"
        model = Qwen2ForCausalLM(Qwen2Config(**fields))
    trunk = {k: v for k, v in hf_state.items() if not k.startswith("model.mtp_layers.")}
    missing, unexpected = model.load_state_dict(trunk, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if hf_config["tie_word_embeddings"]:
        model.tie_weights()
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_equal_hf(arch, tmp_path):
    model, hf_config, hf_state = build(make_tiny_model(tmp_path, arch=arch, seed=3))
    ids = torch.randint(0, hf_config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = M.forward(model, ids, hf_config["vocab_size"]).logits
        ref = hf_model(hf_config, hf_state)(ids).logits
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def mimo_mtp_reference(hf_config: dict, hf_state: dict, ids: torch.Tensor) -> torch.Tensor:
    """MiMo's MTP recurrence from the HF weights (sglang mimo_mtp.py):
    logits[i] = lm_head(final_ln(layer(input_proj(cat[hidden_ln(h[i]), token_ln(embed(ids[i + 1]))]))))
    with h the trunk's final (normed) hidden states; it predicts ids[i + 2]."""
    trunk = hf_model(hf_config, hf_state)
    h = trunk.model(ids).last_hidden_state[:, :-1]
    eps = hf_config["rms_norm_eps"]
    p = "model.mtp_layers.0."

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    emb = hf_state["model.embed_tokens.weight"][ids[:, 1:]].clone()
    emb[:, 0] = 0  # SGLang zeroes the MTP token embedding at position 0
    x = torch.cat([rms(h, hf_state[p + "hidden_layernorm.weight"]), rms(emb, hf_state[p + "token_layernorm.weight"])], -1)
    x = x @ hf_state[p + "input_proj.weight"].T
    # One Qwen2 decoder layer = a one-layer Qwen2 model fed with inputs_embeds (its norm = MTP final_layernorm).
    layer_state = {k.replace(p, "model.layers.0."): v for k, v in hf_state.items()
                   if k.startswith(p) and k.split(".")[3] in ("self_attn", "mlp", "input_layernorm",
                                                              "post_attention_layernorm")}
    layer_state["model.norm.weight"] = hf_state[p + "final_layernorm.weight"]
    layer_state["model.embed_tokens.weight"] = hf_state["model.embed_tokens.weight"]  # unused: inputs_embeds
    layer = hf_model(hf_config, layer_state, num_layers=1)
    out = layer.model(inputs_embeds=x).last_hidden_state
    return out @ hf_state["lm_head.weight"].T


def test_mimo_trunk_and_mtp_logits_equal_hf_reference(tmp_path):
    model, hf_config, hf_state = build(make_tiny_model(tmp_path, arch="mimo", seed=5), mtp_num_layers=1)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = M.forward(model, ids, hf_config["vocab_size"], mtp_zero_first_token=True)
        torch.testing.assert_close(out.logits, hf_model(hf_config, hf_state)(ids).logits, atol=ATOL, rtol=0)
        assert len(out.mtp_logits) == 1
        ref = mimo_mtp_reference(hf_config, hf_state, ids)
    # Megatron's last position sees a rolled-in token: only positions 0..s-2 have a next token.
    torch.testing.assert_close(out.mtp_logits[0][:, :-1], ref, atol=ATOL, rtol=0)


def test_bad_configs_are_clear_errors(tmp_path):
    path = make_tiny_model(tmp_path, arch="qwen2")
    hf_config = M.read_hf_config(path)
    with pytest.raises(ValueError, match="no MTP layers"):
        M.transformer_config(hf_config, TrainConfig(hf_checkpoint=str(path), mtp_num_layers=1))
    with pytest.raises(ValueError, match="--enable-mtp-training needs --mtp-num-layers"):
        M.transformer_config(hf_config, TrainConfig(hf_checkpoint=str(path), enable_mtp_training=True))
    with pytest.raises(ValueError, match="only num_nextn_predict_layers=1"):
        M.transformer_config({**hf_config, "model_type": "mimo", "num_nextn_predict_layers": 1},
                             TrainConfig(hf_checkpoint=str(path), mtp_num_layers=2))


def test_cpu_compat_is_idempotent():
    assert cpu_compat.needed() == (not torch.cuda.is_available())
    assert cpu_compat.apply() is False  # already applied by init_parallel (or CUDA present)
    if cpu_compat.needed():
        assert torch.cuda.current_device() == "cpu"
        state = torch.cuda.get_rng_state()
        a = torch.rand(3)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(3), a)
