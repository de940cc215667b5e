"""The EAGLE3 draft: checkpoint layout as SGLang 0.5.23 loads it, and the reference forward."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.common import eagle3_draft as E
from slime_spec.tools.tiny_model import LLAMA31_ROPE_SCALING, main, make_tiny_eagle3_draft, make_tiny_model


@pytest.fixture(scope="module")
def target_and_draft(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = make_tiny_model(root / "target", arch="llama", num_layers=4, seed=3, rope_scaling=LLAMA31_ROPE_SCALING,
                             rope_theta=500000.0)
    draft = make_tiny_eagle3_draft(root / "draft", target, draft_vocab_size=40, intermediate_size=96)
    return target, draft


# SGLang's LlamaForCausalLMEagle3 parameters (models/llama_eagle3.py) and the shards each loads.
SGLANG_PARAMS = {
    "model.embed_tokens.weight": [None], "model.fc.weight": [None], "model.norm.weight": [None],
    "lm_head.weight": [None], "model.layers.0.hidden_norm.weight": [None],
    "model.layers.0.input_layernorm.weight": [None], "model.layers.0.post_attention_layernorm.weight": [None],
    "model.layers.0.self_attn.qkv_proj.weight": ["q", "k", "v"], "model.layers.0.self_attn.o_proj.weight": [None],
    "model.layers.0.mlp.gate_up_proj.weight": [0, 1], "model.layers.0.mlp.down_proj.weight": [None],
}


class _RecordingParam:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def weight_loader(self, param, tensor, shard_id=None):
        self.log.append((self.name, shard_id, tuple(tensor.shape)))


def test_checkpoint_names_load_one_to_one_through_sglang(target_and_draft):
    """SGLang's own load_weights consumes every draft tensor, and fills every parameter but the shared
    embedding (SGLang takes it from the target)."""
    from tests.conformance import sglang_doubles

    sglang_doubles.install()
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    _, draft_dir = target_and_draft
    state = load_file(str(draft_dir / E.CHECKPOINT_FILE))
    log: list = []

    class Host:
        def named_parameters(self):
            return [(n, _RecordingParam(n, log)) for n in SGLANG_PARAMS]

    host = Host()
    LlamaForCausalLMEagle3.load_weights(host, list(state.items()))
    loaded: dict[str, list] = {}
    for name, shard, _ in log:
        loaded.setdefault(name, []).append(shard)
    assert {n: sorted(s, key=str) for n, s in loaded.items()} == \
        {n: sorted(s, key=str) for n, s in SGLANG_PARAMS.items() if n != "model.embed_tokens.weight"}
    assert len(log) == len(state) - 2  # every tensor but d2t / t2d went into a parameter, none twice
    draft = E.load_draft(draft_dir, num_target_layers=4)
    assert torch.equal(host.hot_token_id, draft.draft_to_target())
    assert set(state) == set(E.trainable_state(draft))  # our names are the checkpoint's names


def test_tiny_draft_config_and_maps(target_and_draft):
    target_dir, draft_dir = target_and_draft
    config = json.loads((draft_dir / "config.json").read_text())
    target = json.loads((target_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["rope_scaling"] == target["rope_scaling"] and not config["tie_word_embeddings"]
    state = load_file(str(draft_dir / E.CHECKPOINT_FILE))
    assert state["fc.weight"].shape == (64, 3 * 64)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # reads cat[embedding, hidden]
    assert state["lm_head.weight"].shape == (40, 64)
    hot = state["d2t"] + torch.arange(40)
    assert hot.tolist() == sorted(hot.tolist()) and 0 not in hot.tolist()
    assert state["t2d"].dtype == torch.bool and state["t2d"].sum() == 40 and bool(state["t2d"][hot].all())


def test_aux_layer_ids():
    assert E.default_aux_layer_ids(32) == [1, 15, 28]  # Llama-3.1-8B: SGLang captures inputs of 2, 16, 29
    assert E.aux_layer_ids({}, 32) == [1, 15, 28]
    assert E.aux_layer_ids({"eagle_config": {E.AUX_IDS_FIELD: [5, 1, 3]}}, 8) == [1, 3, 5]
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        E.aux_layer_ids({}, 4)  # the default [1, 1, 0] repeats a layer for a 4-layer target
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        E.aux_layer_ids({"eagle_config": {E.AUX_IDS_FIELD: [0, 3]}}, 4)  # the last layer is never captured


def hf_reference_step(draft: E.Eagle3Draft, embeds, aux, positions):
    """The same step through transformers' Llama attention and MLP modules (q/k/v widened to 2H)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRotaryEmbedding

    c = draft.config
    h = c["hidden_size"]
    wide = LlamaConfig(**{**{k: v for k, v in c.items() if k not in ("architectures", "eagle_config")},
                          "hidden_size": 2 * h, "_attn_implementation": "eager"})
    attn = LlamaAttention(wide, layer_idx=0)
    attn.o_proj = torch.nn.Linear(c["num_attention_heads"] * c["head_dim"], h, bias=False)
    src = draft.midlayer.self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(attn, name).weight.data.copy_(getattr(src, name).weight)
    mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=c["intermediate_size"], hidden_act="silu"))
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, name).weight.data.copy_(getattr(draft.midlayer.mlp, name).weight)
    rotary_config = LlamaConfig(**{k: v for k, v in c.items() if k not in ("architectures", "eagle_config")})
    rotary = LlamaRotaryEmbedding(rotary_config)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"]) * w

    m = draft.midlayer
    hidden = aux @ draft.fc.weight.T
    x = torch.cat([rms(embeds, m.input_layernorm.weight), rms(hidden, m.hidden_norm.weight)], -1)
    s = x.shape[1]
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    a, _ = attn(x, position_embeddings=rotary(x, positions), attention_mask=mask)
    residual = hidden + a
    out = residual + mlp(rms(residual, m.post_attention_layernorm.weight))
    return rms(out, draft.norm.weight) @ draft.lm_head.weight.T, out


def test_forward_equals_transformers_modules(target_and_draft):
    target_dir, draft_dir = target_and_draft
    draft = E.load_draft(draft_dir, num_target_layers=4)
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(2, 90, 64, generator=gen)
    aux = torch.randn(2, 90, 192, generator=gen)
    positions = torch.arange(90)[None].expand(2, -1) + torch.tensor([[0], [7]])
    with torch.no_grad():
        logits, out = draft(embeds, aux, positions)
        ref_logits, ref_out = hf_reference_step(draft, embeds, aux, positions)
    assert logits.shape == (2, 90, 40)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # a later step feeds the previous pre-norm output (fc skipped)
        again, _ = draft(embeds, out, positions)
    assert again.shape == logits.shape and not torch.allclose(again, logits)


def test_save_load_round_trip_and_errors(target_and_draft, tmp_path):
    _, draft_dir = target_and_draft
    draft = E.load_draft(draft_dir, num_target_layers=4)
    copy = E.load_draft(E.save_draft(draft, tmp_path / "copy"), num_target_layers=4)
    for (n, a), (m, b) in zip(E.trainable_state(draft).items(), E.trainable_state(copy).items()):
        assert n == m and torch.equal(a, b)
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        E.read_draft_config(make_tiny_model(tmp_path / "plain", arch="llama"))
    with pytest.raises(ValueError, match="num_layers >= 4"):
        make_tiny_eagle3_draft(tmp_path / "d", make_tiny_model(tmp_path / "two", arch="llama", num_layers=2))


def test_cli_writes_target_and_draft(tmp_path):
    assert main(["--arch", "llama", "--num-layers", "4", "--llama31-rope", "--out", str(tmp_path / "t"),
                 "--eagle3-draft", str(tmp_path / "d"), "--draft-vocab", "32"]) == 0
    assert json.loads((tmp_path / "t" / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    assert E.load_draft(tmp_path / "d", num_target_layers=4).draft_vocab_size == 32
