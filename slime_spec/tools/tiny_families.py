"""The tiny checkpoints' config.json and random weights, per family, by HF names.

Dense Llama / Qwen2 / Qwen3 layers, Qwen3-MoE experts, MiMo's MTP layers (`model.mtp_layers.{i}`), and the
DeepSeek-V3 / GLM-4.5 / GLM-4.7-Flash layout (MLA or GQA attention, routed and shared experts with the router's
`e_score_correction_bias`, dense-first layers, MTP layers as `model.layers.{num_hidden_layers + i}`).
"""

from __future__ import annotations

import math

import torch

from slime_spec.common.model_families import (
    ARCHITECTURES,
    FAMILIES,
    MLA_FAMILIES,
    MTP_FAMILIES,
    NEXTN_FAMILIES,
    QK_NORM_FAMILIES,
)
from slime_spec.tools.tiny_tokenizer import BOS_ID, EOS_ID, PAD_ID

ARCHS = FAMILIES
QK_NORM_ARCHS = QK_NORM_FAMILIES
# Families whose MTP layers are decoder layers past the last one, `model.layers.{num_hidden_layers + i}`, each with
# its own copy of the embedding (`embed_tokens`) and head (`shared_head.head`), as their released checkpoints store.
SHARED_HEAD_MTP_ARCHS = NEXTN_FAMILIES
MLA_ARCHS = MLA_FAMILIES
MTP_ARCHS = MTP_FAMILIES
# Llama-3.1's RoPE scaling with a short original context, so a tiny model's positions reach the blended band.
LLAMA31_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}


def make_config(arch: str, *, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                num_kv_heads: int, intermediate_size: int, max_position_embeddings: int, dtype: str,
                mtp_layers: int, tie_word_embeddings: bool, rope_scaling: dict | None = None,
                rope_theta: float = 10000.0, head_dim: int | None = None, num_experts: int = 4,
                num_experts_per_tok: int = 2, first_k_dense_replace: int = 1) -> dict:
    """head_dim: None = hidden_size / num_heads; Qwen3 checkpoints set their own (Qwen3-4B: 32 heads of 128 over
    a hidden size of 2560). num_experts / num_experts_per_tok: the routed experts of qwen3_moe (every layer sparse,
    as Qwen3-30B-A3B), deepseek_v3 and glm4_moe (layers from `first_k_dense_replace` on sparse, one shared expert);
    each expert half intermediate_size wide."""
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: choose one of {ARCHS}")
    if (head_dim is None and hidden_size % num_heads) or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size={hidden_size} must divide by num_heads={num_heads} (or pass head_dim), "
                         f"and num_heads by num_kv_heads={num_kv_heads}")
    if head_dim is not None and (head_dim < 2 or head_dim % 2):
        raise ValueError(f"head_dim={head_dim}: RoPE needs an even head dimension >= 2")
    if arch in ("qwen3_moe", *SHARED_HEAD_MTP_ARCHS) and not 1 <= num_experts_per_tok <= num_experts:
        raise ValueError(f"num_experts_per_tok={num_experts_per_tok}: choose 1..num_experts={num_experts}")
    if arch in SHARED_HEAD_MTP_ARCHS:
        return _shared_head_mtp_config(
            arch, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
            num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings, dtype=dtype, mtp_layers=mtp_layers,
            tie_word_embeddings=tie_word_embeddings, rope_theta=rope_theta, head_dim=head_dim,
            num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
            first_k_dense_replace=first_k_dense_replace)
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": dtype,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if arch in QK_NORM_ARCHS:  # Qwen3 has no qkv bias and says so (SGLang's Qwen3 reads config.attention_bias)
        config.update(attention_bias=False, rope_scaling=None)
    if arch == "qwen3_moe":
        config.update(decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=max(1, intermediate_size // 2),
                      num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, norm_topk_prob=True,
                      output_router_logits=False, router_aux_loss_coef=0.001)
    if rope_scaling is not None:
        config["rope_scaling"] = dict(rope_scaling)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers,
                      attention_dropout=0.0)
    if arch == "mimo":
        config["num_nextn_predict_layers"] = mtp_layers
    return config


def _shared_head_mtp_config(arch: str, *, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                            num_kv_heads: int, intermediate_size: int, max_position_embeddings: int, dtype: str,
                            mtp_layers: int, tie_word_embeddings: bool, rope_theta: float, head_dim: int | None,
                            num_experts: int, num_experts_per_tok: int, first_k_dense_replace: int) -> dict:
    """DeepSeek-V3's / GLM-4.5's config.json, keys as their released checkpoints have them, sizes scaled down.

    DeepSeek-V3: multi-latent attention (q_lora_rank, kv_lora_rank, qk_nope/rope head dims, v_head_dim; every head
    its own key/value, so num_key_value_heads = num_attention_heads), YaRN RoPE scaling, sigmoid routing with a
    correction bias (topk_method noaux_tc) over n_group groups. GLM-4.5: grouped-query attention with a qkv bias
    and partial RoPE (partial_rotary_factor 0.5), head_dim apart from hidden / heads, no q/k norm (use_qk_norm
    false), one group. GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's attention with plain RoPE, GLM's one group and
    routed scaling factor 1.8, as its release's config.json.
    """
    if not 0 <= first_k_dense_replace < num_layers:
        raise ValueError(f"first_k_dense_replace={first_k_dense_replace}: choose 0..num_layers-1={num_layers - 1} "
                         "so at least one layer is sparse")
    if num_layers < 2:  # SGLang's NextN loaders read a one-layer model's MTP layer as model.layers.0
        raise ValueError(f"num_layers={num_layers}: {arch} needs at least 2 layers")
    moe = dict(n_routed_experts=num_experts, n_shared_experts=1, num_experts_per_tok=num_experts_per_tok,
               moe_intermediate_size=max(1, intermediate_size // 2), first_k_dense_replace=first_k_dense_replace,
               norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=mtp_layers)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, hidden_act="silu",
                  max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, rope_theta=rope_theta,
                  rope_scaling=None, attention_dropout=0.0, tie_word_embeddings=tie_word_embeddings,
                  bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype=dtype,
                  initializer_range=0.02, use_cache=True)
    d = head_dim or hidden_size // num_heads
    mla = {"num_key_value_heads": num_heads, "attention_bias": False,  # every head its own key and value
           "q_lora_rank": max(2, hidden_size // 2), "kv_lora_rank": max(2, hidden_size // 4),
           "qk_nope_head_dim": d, "qk_rope_head_dim": max(2, d // 2), "v_head_dim": d}
    if arch == "glm4_moe_lite":
        return {"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", **common, **mla,
                **moe, "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1, "rope_interleave": True,
                "pretraining_tp": 1}
    if arch == "deepseek_v3":  # YaRN as released (factor 40 over 4096 there), the factor scaled to a tiny context
        common["rope_scaling"] = {"beta_fast": 32, "beta_slow": 1, "factor": 4.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "type": "yarn",
                                  "original_max_position_embeddings": max(1, max_position_embeddings // 4)}
        if num_experts % 2:
            raise ValueError(f"num_experts={num_experts}: deepseek_v3 routes over n_group=2 groups; choose an even "
                             "number")
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common, **mla,
                **moe, "n_group": 2, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                "moe_layer_freq": 1, "ep_size": 1, "aux_loss_alpha": 0.001, "seq_aux": True,
                "pretraining_tp": 1}
    return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **common,
            "num_key_value_heads": num_kv_heads, "head_dim": head_dim or 2 * hidden_size // num_heads,
            "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False,
            **moe, "n_group": 1, "topk_group": 1}


def _decoder_layer(prefix: str, config: dict, gen: torch.Generator, qkv_bias: bool,
                   qk_norm: bool = False) -> dict[str, torch.Tensor]:
    h, i = config["hidden_size"], config["intermediate_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    w = {
        f"{prefix}.input_layernorm.weight": norm(),
        f"{prefix}.self_attn.q_proj.weight": linear(q, h),
        f"{prefix}.self_attn.k_proj.weight": linear(kv, h),
        f"{prefix}.self_attn.v_proj.weight": linear(kv, h),
        f"{prefix}.self_attn.o_proj.weight": linear(h, q) * 0.5,
        f"{prefix}.post_attention_layernorm.weight": norm(),
    }
    if "num_experts" in config:  # Qwen3-MoE: a router (`mlp.gate`) over per-expert SwiGLU MLPs
        e, i = config["num_experts"], config["moe_intermediate_size"]
        w[f"{prefix}.mlp.gate.weight"] = 4.0 * linear(e, h)  # decisive routing: no near-ties in the top-k
        for x in range(e):
            w[f"{prefix}.mlp.experts.{x}.gate_proj.weight"] = linear(i, h)
            w[f"{prefix}.mlp.experts.{x}.up_proj.weight"] = linear(i, h)
            w[f"{prefix}.mlp.experts.{x}.down_proj.weight"] = linear(h, i) * 0.5
    else:
        w[f"{prefix}.mlp.gate_proj.weight"] = linear(i, h)
        w[f"{prefix}.mlp.up_proj.weight"] = linear(i, h)
        w[f"{prefix}.mlp.down_proj.weight"] = linear(h, i) * 0.5
    if qkv_bias:
        for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            w[f"{prefix}.self_attn.{name}.bias"] = 0.1 * torch.randn(n, generator=gen)
    if qk_norm:  # Qwen3: one RMSNorm over each head's dims, shared by the heads
        w[f"{prefix}.self_attn.q_norm.weight"] = 1.0 + 0.1 * torch.randn(hd, generator=gen)
        w[f"{prefix}.self_attn.k_norm.weight"] = 1.0 + 0.1 * torch.randn(hd, generator=gen)
    return w


def _shared_head_mtp_family_layer(prefix: str, config: dict, gen: torch.Generator,
                                  sparse: bool) -> dict[str, torch.Tensor]:
    """One DeepSeek-V3 / GLM-4.7-Flash (MLA) or GLM-4.5 (GQA with qkv bias) decoder layer; `sparse`: routed
    experts, a router with its correction bias and one shared expert in place of the dense MLP."""
    h, heads = config["hidden_size"], config["num_attention_heads"]

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)

    def norm(n: int = h) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    a = f"{prefix}.self_attn."
    w = {f"{prefix}.input_layernorm.weight": norm(), f"{prefix}.post_attention_layernorm.weight": norm()}
    if config["model_type"] in MLA_ARCHS:
        q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
        nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        w.update({a + "q_a_proj.weight": linear(q_rank, h), a + "q_a_layernorm.weight": norm(q_rank),
                  a + "q_b_proj.weight": linear(heads * (nope + rope), q_rank),
                  a + "kv_a_proj_with_mqa.weight": linear(kv_rank + rope, h),
                  a + "kv_a_layernorm.weight": norm(kv_rank),
                  a + "kv_b_proj.weight": linear(heads * (nope + v), kv_rank),
                  a + "o_proj.weight": linear(h, heads * v) * 0.5})
    else:
        hd = config["head_dim"]
        q, kv = heads * hd, config["num_key_value_heads"] * hd
        for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            w[f"{a}{name}.weight"] = linear(n, h)
            w[f"{a}{name}.bias"] = 0.1 * torch.randn(n, generator=gen)
        w[a + "o_proj.weight"] = linear(h, q) * 0.5
    if sparse:
        e, i = config["n_routed_experts"], config["moe_intermediate_size"]
        w[f"{prefix}.mlp.gate.weight"] = 4.0 * linear(e, h)  # decisive routing: no near-ties in the top-k
        w[f"{prefix}.mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(e, generator=gen)
        mlps = [(f"experts.{x}", i) for x in range(e)] + [("shared_experts", i * config["n_shared_experts"])]
    else:
        mlps = [("", config["intermediate_size"])]
    for name, width in mlps:
        m = f"{prefix}.mlp.{name}." if name else f"{prefix}.mlp."
        w.update({m + "gate_proj.weight": linear(width, h), m + "up_proj.weight": linear(width, h),
                  m + "down_proj.weight": linear(h, width) * 0.5})
    return w


def make_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights scaled so activations keep unit size and logits are peaked (no near-ties in greedy)."""
    gen = torch.Generator().manual_seed(seed)
    h, v = config["hidden_size"], config["vocab_size"]
    qkv_bias = config["model_type"] in ("qwen2", "mimo")
    qk_norm = config["model_type"] in QK_NORM_ARCHS
    # A tied embedding is also the lm_head: scale it so logits have the same spread as an untied head.
    embed_std = 2.0 / math.sqrt(h) if config["tie_word_embeddings"] else 1.0
    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen) * embed_std}
    shared_head_mtp = config["model_type"] in SHARED_HEAD_MTP_ARCHS
    n_layers = config["num_hidden_layers"]
    for layer in range(n_layers):
        if shared_head_mtp:
            w.update(_shared_head_mtp_family_layer(f"model.layers.{layer}", config, gen,
                                                   sparse=layer >= config["first_k_dense_replace"]))
        else:
            w.update(_decoder_layer(f"model.layers.{layer}", config, gen, qkv_bias, qk_norm))
    w["model.norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = torch.randn(v, h, generator=gen) * (2.0 / math.sqrt(h))
    for k in range(config.get("num_nextn_predict_layers", 0) if shared_head_mtp else 0):
        p = f"model.layers.{n_layers + k}"
        w.update(_shared_head_mtp_family_layer(p, config, gen, sparse=True))
        w[f"{p}.enorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        w[f"{p}.hnorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        w[f"{p}.eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen) / math.sqrt(2 * h)
        w[f"{p}.shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        w[f"{p}.embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
        w[f"{p}.shared_head.head.weight"] = w.get("lm_head.weight", w["model.embed_tokens.weight"]).clone()
    for k in range(0 if shared_head_mtp else config.get("num_nextn_predict_layers", 0)):
        p = f"model.mtp_layers.{k}"
        w[f"{p}.token_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        w[f"{p}.hidden_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        w[f"{p}.input_proj.weight"] = torch.randn(h, 2 * h, generator=gen) / math.sqrt(2 * h)
        w.update(_decoder_layer(p, config, gen, qkv_bias))
        w[f"{p}.final_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    return w
