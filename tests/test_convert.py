"""Megatron <-> HF name and layout conversion (pure functions; no Megatron import)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.weight_sync import convert


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mimo"])
def tiny(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, mtp_layers=1)
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


def to_hf(family, megatron_state, hf_config):
    out = {}
    for name, tensor in megatron_state.items():
        for hf_name, hf_tensor in convert.megatron_to_hf(family, name, tensor, hf_config):
            assert hf_name not in out, f"{hf_name} produced twice"
            out[hf_name] = hf_tensor
    return out


def test_round_trip_hf_megatron_hf_is_exact(tiny):
    hf_config, hf_state = tiny
    family = convert.family_of(hf_config)
    megatron_state = convert.hf_to_megatron(family, hf_state, hf_config)
    back = to_hf(family, megatron_state, hf_config)
    assert sorted(back) == sorted(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(back[name], tensor), name
    again = convert.hf_to_megatron(family, back, hf_config)
    assert all(torch.equal(again[k], megatron_state[k]) for k in megatron_state)


def test_megatron_names_and_mtp_placement(tiny):
    hf_config, hf_state = tiny
    family = convert.family_of(hf_config)
    megatron_state = convert.hf_to_megatron(family, hf_state, hf_config)
    qkv = megatron_state["decoder.layers.0.self_attention.linear_qkv.weight"]
    d = hf_config["head_dim"]  # 16 = 64 / 4 heads; qwen3's own, 32
    assert qkv.shape == (4 * d + 2 * 2 * d, 64)  # 4 heads x d + 2 kv groups x (k + v) x d
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in megatron_state) == (family in ("qwen2", "mimo"))
    qk_norms = {n for n in megatron_state if n.endswith(("q_layernorm.weight", "k_layernorm.weight"))}
    if family == "qwen3":
        assert d != 64 // 4  # head_dim apart from hidden / heads, as Qwen3's checkpoints have it
        assert qk_norms == {f"decoder.layers.{i}.self_attention.{qk}_layernorm.weight"
                            for i in range(hf_config["num_hidden_layers"]) for qk in "qk"}
        assert megatron_state["decoder.layers.1.self_attention.k_layernorm.weight"] is \
            hf_state["model.layers.1.self_attn.k_norm.weight"]
        assert convert.tp_split_dim("decoder.layers.1.self_attention.q_layernorm.weight") is None  # shared by heads
    else:
        assert not qk_norms
    mtp = sorted(n for n in megatron_state if convert.is_mtp_param(n))
    if family == "mimo":
        assert "mtp.layers.0.eh_proj.weight" in mtp and "mtp.layers.0.transformer_layer.mlp.linear_fc1.weight" in mtp
        assert len(mtp) == 11
    else:
        assert mtp == []
    assert ("output_layer.weight" in megatron_state) == (not hf_config["tie_word_embeddings"])


def test_qkv_is_interleaved_per_query_group():
    cfg = {"hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2, "vocab_size": 10,
           "num_hidden_layers": 1}
    # Row r of q/k/v holds the value (head, row-in-head) so the fused layout can be read off.
    q = torch.arange(8).repeat_interleave(8).reshape(8, 8).float()
    k = 100 + torch.arange(4).repeat_interleave(8).reshape(4, 8).float()
    v = 200 + torch.arange(4).repeat_interleave(8).reshape(4, 8).float()
    state = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
             "model.layers.0.self_attn.v_proj.weight": v}
    fused = convert.hf_to_megatron("qwen2", state, cfg)["decoder.layers.0.self_attention.linear_qkv.weight"]
    # group 0: q heads 0,1 (rows 0-3), k group 0 (rows 0-1), v group 0; then group 1.
    assert fused[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    split = dict(convert.megatron_to_hf("qwen2", "decoder.layers.0.self_attention.linear_qkv.weight", fused, cfg))
    assert torch.equal(split["model.layers.0.self_attn.q_proj.weight"], q)


def test_gate_up_split_and_mimo_eh_proj_halves_swap():
    cfg = {"hidden_size": 4, "num_attention_heads": 2, "vocab_size": 10, "num_hidden_layers": 2}
    fc1 = torch.cat([torch.zeros(6, 4), torch.ones(6, 4)])
    gate, up = convert.megatron_to_hf("mimo", "decoder.layers.1.mlp.linear_fc1.weight", fc1, cfg)
    assert gate[0] == "model.layers.1.mlp.gate_proj.weight" and gate[1].sum() == 0
    assert up[0] == "model.layers.1.mlp.up_proj.weight" and up[1].sum() == 24
    # Megatron: eh_proj(cat[embedding, hidden]); MiMo: input_proj(cat[hidden, embedding]).
    eh = torch.cat([torch.full((4, 4), 1.0), torch.full((4, 4), 2.0)], dim=1)  # [E-columns | H-columns]
    ((name, input_proj),) = convert.megatron_to_hf("mimo", "mtp.layers.0.eh_proj.weight", eh, cfg)
    assert name == "model.mtp_layers.0.input_proj.weight"
    assert input_proj[:, :4].eq(2.0).all() and input_proj[:, 4:].eq(1.0).all()
    ((name, kept),) = convert.megatron_to_hf("deepseek_v3", "mtp.layers.0.eh_proj.weight", eh, cfg)
    assert name == "model.layers.2.eh_proj.weight" and torch.equal(kept, eh)  # same order as Megatron


def _moe_mtp_megatron_state(family: str, h: int = 16) -> dict[str, torch.Tensor]:
    """Every Megatron parameter of one DeepSeek-V3 / GLM-4.5 MTP layer (MoE MLP, 2 routed experts)."""
    g = torch.Generator().manual_seed(0)
    p = "mtp.layers.0."
    t = p + "transformer_layer."
    names = {p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
             p + "final_layernorm.weight": (h,), t + "input_layernorm.weight": (h,),
             t + "self_attention.linear_proj.weight": (h, 32), t + "pre_mlp_layernorm.weight": (h,),
             t + "mlp.router.weight": (2, h), t + "mlp.router.expert_bias": (2,),
             t + "mlp.shared_experts.linear_fc1.weight": (16, h), t + "mlp.shared_experts.linear_fc2.weight": (h, 8)}
    for e in range(2):
        names[t + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (16, h)
        names[t + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, 8)
    if family == "deepseek_v3":
        names.update({t + "self_attention.linear_q_down_proj.weight": (8, h),
                      t + "self_attention.q_layernorm.weight": (8,),
                      t + "self_attention.linear_q_up_proj.weight": (4 * 12, 8),
                      t + "self_attention.linear_kv_down_proj.weight": (8 + 4, h),
                      t + "self_attention.kv_layernorm.weight": (8,),
                      t + "self_attention.linear_kv_up_proj.weight": (4 * 16, 8)})
    else:
        names.update({t + "self_attention.linear_qkv.weight": ((4 + 2 + 2) * 8, h),
                      t + "self_attention.linear_qkv.bias": ((4 + 2 + 2) * 8,)})
    return {n: torch.randn(*shape, generator=g) for n, shape in names.items()}


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_every_deepseek_glm_mtp_name_maps(family):
    cfg = {"model_type": family, "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "num_hidden_layers": 3, "vocab_size": 10, "num_nextn_predict_layers": 1}
    assert convert.family_of(cfg) == family
    state = _moe_mtp_megatron_state(family)
    hf = to_hf(family, state, cfg)
    own = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "input_layernorm.weight",
           "post_attention_layernorm.weight", "self_attn.o_proj.weight", "mlp.gate.weight",
           "mlp.gate.e_score_correction_bias", "mlp.shared_experts.gate_proj.weight",
           "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight"}
    own |= {f"mlp.experts.{e}.{w}_proj.weight" for e in range(2) for w in ("gate", "up", "down")}
    if family == "deepseek_v3":
        own |= {"self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
                "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight"}
    else:
        own |= {f"self_attn.{x}_proj.{w}" for x in "qkv" for w in ("weight", "bias")}
    assert set(hf) == {f"model.layers.3.{n}" for n in own}  # num_hidden_layers + 0
    # DeepSeek's per-MTP-layer embedding/head copies are accepted and dropped (Megatron shares the main ones).
    hf["model.layers.3.embed_tokens.weight"] = torch.zeros(10, 16)
    hf["model.layers.3.shared_head.head.weight"] = torch.zeros(10, 16)
    back = convert.hf_to_megatron(family, hf, cfg)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_unknown_names_are_errors():
    cfg = {"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10, "num_hidden_layers": 1}
    with pytest.raises(ValueError, match="decoder.layers.0.self_attention.rotary.weight"):
        convert.megatron_to_hf("llama", "decoder.layers.0.self_attention.rotary.weight", torch.zeros(1), cfg)
    with pytest.raises(ValueError, match="no MTP layers"):
        convert.megatron_to_hf("qwen2", "mtp.layers.0.enorm.weight", torch.zeros(8), cfg)
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.0.gate_proj.weight"):
        convert.hf_to_megatron("llama", {"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(1)}, cfg)
    with pytest.raises(ValueError, match="past num_hidden_layers"):
        convert.hf_to_megatron("llama", {"model.layers.1.input_layernorm.weight": torch.zeros(8)}, cfg)
    with pytest.raises(ValueError, match="needs q, k and v"):
        convert.hf_to_megatron("llama", {"model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8)}, cfg)
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        convert.family_of({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="unknown Megatron parameter"):
        convert.tp_split_dim("decoder.layers.0.mystery.weight")


def test_tp_split_then_merge_is_identity_and_vocab_padding_is_cut(tiny):
    hf_config, hf_state = tiny
    family = convert.family_of(hf_config)
    for name, full in convert.hf_to_megatron(family, hf_state, hf_config).items():
        if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
            full = torch.cat([full, torch.zeros(1, full.shape[1])])  # vocab padded to a multiple of TP=2
        shards = [convert.split_tp_shard(name, full, r, 2) for r in range(2)]
        if convert.tp_split_dim(name) is not None:
            assert shards[0].shape != full.shape, name
        merged = convert.merge_tp_shards("module." + name, shards)
        assert torch.equal(merged, full), name
        for hf_name, tensor in convert.megatron_to_hf(family, name, merged, hf_config):
            assert torch.equal(tensor, hf_state[hf_name]), hf_name


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def tiny_moe_mtp(request, tmp_path_factory):
    """A make-tiny-model DeepSeek-V3 / GLM-4.5 checkpoint: a dense layer, a sparse one, one MTP layer."""
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, mtp_layers=1)
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


def test_deepseek_glm_round_trip_is_exact(tiny_moe_mtp):
    """Every tensor of the released layout comes back, but the MTP layer's copies of the embedding and head, which
    Megatron's MTP shares with the main model (SGLang's NextN draft takes the target's too)."""
    hf_config, hf_state = tiny_moe_mtp
    family = convert.family_of(hf_config)
    megatron_state = convert.hf_to_megatron(family, hf_state, hf_config)
    back = to_hf(family, megatron_state, hf_config)
    n = hf_config["num_hidden_layers"]
    assert sorted(set(hf_state) - set(back)) == [f"model.layers.{n}.embed_tokens.weight",
                                                 f"model.layers.{n}.shared_head.head.weight"]
    assert set(back) <= set(hf_state)
    for name, tensor in back.items():
        assert torch.equal(tensor, hf_state[name]), name
    again = convert.hf_to_megatron(family, back, hf_config)
    assert sorted(again) == sorted(megatron_state)


def test_deepseek_glm_megatron_names(tiny_moe_mtp):
    """megatron-core's names: MLA's down/up projections and their norms (local spec), the router and its expert bias,
    sequential experts, shared experts, a dense MLP in the layers before first_k_dense_replace."""
    hf_config, hf_state = tiny_moe_mtp
    family = convert.family_of(hf_config)
    mg = convert.hf_to_megatron(family, hf_state, hf_config)
    dense, sparse, mtp = "decoder.layers.0.", "decoder.layers.1.", "mtp.layers.0.transformer_layer."
    assert dense + "mlp.linear_fc1.weight" in mg and dense + "mlp.router.weight" not in mg
    for p in (sparse, mtp):
        assert torch.equal(mg[p + "mlp.router.expert_bias"],
                           hf_state[(p.replace("decoder.layers.1.", "model.layers.1.")
                                     .replace(mtp, "model.layers.2.")) + "mlp.gate.e_score_correction_bias"])
        e = hf_config["n_routed_experts"]
        assert {f"{p}mlp.experts.local_experts.{x}.linear_fc{k}.weight" for x in range(e) for k in (1, 2)} <= set(mg)
        assert mg[p + "mlp.shared_experts.linear_fc1.weight"].shape[0] == 2 * hf_config["moe_intermediate_size"]
    attention = {n.split("self_attention.")[1] for n in mg if n.startswith(dense + "self_attention.")}
    if family == "deepseek_v3":
        assert attention == {"linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight",
                             "linear_kv_down_proj.weight", "kv_layernorm.weight", "linear_kv_up_proj.weight",
                             "linear_proj.weight"}
        # TransformerEngine's spec fuses the norms into the up projections; those names map to the same HF tensors.
        for te, local in (("linear_q_up_proj.layer_norm_weight", "q_layernorm.weight"),
                          ("linear_kv_up_proj.layer_norm_weight", "kv_layernorm.weight")):
            t = mg[dense + "self_attention." + local]
            assert convert.megatron_to_hf(family, dense + "self_attention." + te, t, hf_config) == \
                convert.megatron_to_hf(family, dense + "self_attention." + local, t, hf_config)
    else:
        assert attention == {"linear_qkv.weight", "linear_qkv.bias", "linear_proj.weight"}  # use_qk_norm false
    assert {n for n in mg if n.startswith("mtp.layers.0.") and "transformer_layer" not in n} == {
        f"mtp.layers.0.{x}.weight" for x in ("enorm", "hnorm", "eh_proj", "final_layernorm")}


def test_deepseek_glm_tp_split_then_merge_is_identity(tiny_moe_mtp):
    hf_config, hf_state = tiny_moe_mtp
    family = convert.family_of(hf_config)
    for name, full in convert.hf_to_megatron(family, hf_state, hf_config).items():
        if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
            full = torch.cat([full, torch.zeros(1, full.shape[1])])  # vocab padded to a multiple of TP=2
        shards = [convert.split_tp_shard(name, full, r, 2) for r in range(2)]
        assert torch.equal(convert.merge_tp_shards(name, shards), full), name
        if name.endswith(("router.weight", "router.expert_bias", "layernorm.weight")):
            assert convert.tp_split_dim(name) is None, name
