"""Write a small random HF checkpoint (config.json, model.safetensors, a character-level tokenizer).

Tests, benchmarks and the CPU demo build every model they use with this: no hub access is needed.
The checkpoint is a real Llama / Qwen2 / Qwen3 / Qwen3-MoE / MiMo / DeepSeek-V3 / GLM-4.5 checkpoint by HF names,
loadable by transformers (all but MiMo; transformers reads no MTP layer) and by
`slime_spec.engine.model_executor.model` (the dense
families and Qwen3-MoE). DeepSeek-V3 and GLM-4.5 checkpoints have their released config.json keys and tensor names
(MLA, routed and shared experts with the router's `e_score_correction_bias`, dense-first layers, MTP layers as
`model.layers.{num_hidden_layers + i}`), unquantized. Deterministic by `seed`.

CLI: `slime-spec make-tiny-model --arch llama|qwen2|qwen3|qwen3_moe|mimo|deepseek_v3|glm4_moe [--mtp-layers K]
[--vocab N] --out DIR`;
`--arch llama --num-layers 4 --eagle3-draft DRAFT_DIR [--draft-vocab N]` also writes an EAGLE3 draft for it.
"""

from __future__ import annotations

import argparse
import json
import math
import string
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from slime_spec.common.dtypes import DTYPES, canonical_dtype, torch_dtype

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mimo", "deepseek_v3", "glm4_moe")
QK_NORM_ARCHS = ("qwen3", "qwen3_moe")
# Families whose MTP layers are decoder layers past the last one, `model.layers.{num_hidden_layers + i}`, each with
# its own copy of the embedding (`embed_tokens`) and head (`shared_head.head`), as their released checkpoints store.
SHARED_HEAD_MTP_ARCHS = ("deepseek_v3", "glm4_moe")
MTP_ARCHS = ("mimo", *SHARED_HEAD_MTP_ARCHS)
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# Most useful characters first, so a truncated vocabulary (--vocab smaller than the full one) keeps them.
CHARACTERS = (" \n" + string.ascii_lowercase + string.digits + ".,!?'\"-:;()" + string.ascii_uppercase
              + "".join(c for c in string.punctuation if c not in ".,!?'\"-:;()"))
# Llama-3.1's RoPE scaling with a short original context, so a tiny model's positions reach the blended band.
LLAMA31_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def full_vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(CHARACTERS)


def _byte_level_char(c: str) -> str:
    """GPT-2's byte-to-unicode map for one ASCII character (what a ByteLevel pre-tokenizer emits)."""
    b = ord(c)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in printable:
        return c
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def _vocab(vocab_size: int) -> dict[str, int]:
    n_chars = min(len(CHARACTERS), vocab_size - len(SPECIAL_TOKENS))
    if n_chars < 2:
        raise ValueError(f"vocab_size={vocab_size} is too small: need at least {len(SPECIAL_TOKENS) + 2} "
                         f"({len(SPECIAL_TOKENS)} special tokens + 2 characters)")
    tokens = list(SPECIAL_TOKENS) + [_byte_level_char(c) for c in CHARACTERS[:n_chars]]
    return {tok: i for i, tok in enumerate(tokens)}


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A character-level tokenizer: byte-level BPE without merges, so every ASCII character is one token.

    Byte-level (like Qwen2's) because transformers rebuilds a qwen2 checkpoint's tokenizer with Qwen2's
    byte-level pipeline from the vocabulary; the same vocabulary then works for every family.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = _vocab(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # The special tokens are already in the vocabulary, so add_special_tokens keeps their ids.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for t in SPECIAL_TOKENS:
        if tok.token_to_id(t) != vocab[t]:
            raise RuntimeError(f"tokenizers assigned {t!r} id {tok.token_to_id(t)}, expected {vocab[t]}")
    tok.save(str(out_dir / "tokenizer.json"))
    special_map = {"pad_token": "<|pad|>", "bos_token": "<|bos|>", "eos_token": "<|eos|>", "unk_token": "<|pad|>",
                   "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
              "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE, **special_map}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


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
        "architectures": {"llama": ["LlamaForCausalLM"], "qwen2": ["Qwen2ForCausalLM"],
                          "qwen3": ["Qwen3ForCausalLM"], "qwen3_moe": ["Qwen3MoeForCausalLM"],
                          "mimo": ["MiMoForCausalLM"]}[arch],
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
    false), one group.
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
    if arch == "deepseek_v3":  # YaRN as released (factor 40 over 4096 there), the factor scaled to a tiny context
        common["rope_scaling"] = {"beta_fast": 32, "beta_slow": 1, "factor": 4.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "type": "yarn",
                                  "original_max_position_embeddings": max(1, max_position_embeddings // 4)}
        d = head_dim or hidden_size // num_heads
        if num_experts % 2:
            raise ValueError(f"num_experts={num_experts}: deepseek_v3 routes over n_group=2 groups; choose an even "
                             "number")
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
                "num_key_value_heads": num_heads, "attention_bias": False,
                "q_lora_rank": max(2, hidden_size // 2), "kv_lora_rank": max(2, hidden_size // 4),
                "qk_nope_head_dim": d, "qk_rope_head_dim": max(2, d // 2), "v_head_dim": d,
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
    """One DeepSeek-V3 (MLA) or GLM-4.5 (GQA with qkv bias) decoder layer; `sparse`: routed experts, a router with
    its correction bias and one shared expert in place of the dense MLP."""
    h, heads = config["hidden_size"], config["num_attention_heads"]

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)

    def norm(n: int = h) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    a = f"{prefix}.self_attn."
    w = {f"{prefix}.input_layernorm.weight": norm(), f"{prefix}.post_attention_layernorm.weight": norm()}
    if config["model_type"] == "deepseek_v3":
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


def make_tiny_model(out_dir: str | Path, arch: str = "llama", mtp_layers: int = 1, vocab_size: int | None = None,
                    hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 128, max_position_embeddings: int = 1024, seed: int = 0,
                    dtype: str = "float32", init_from: str | None = None,
                    tie_word_embeddings: bool | None = None, rope_scaling: dict | None = None,
                    rope_theta: float | None = None, head_dim: int | None = None, num_experts: int = 4,
                    num_experts_per_tok: int = 2, first_k_dense_replace: int = 1) -> Path:
    """Write a random checkpoint to `out_dir` and return its path.

    vocab_size: None = every special token and character (see `full_vocab_size()`); smaller keeps the
      first characters of `CHARACTERS`; larger adds unused embedding rows.
    init_from: a checkpoint directory; every tensor of the same name and shape is copied from it (e.g. a
      1-layer draft sharing the target's embedding and lm_head, or a MiMo whose base is a given Qwen2).
    tie_word_embeddings: None = the family's usual choice (llama False, qwen2 True, qwen3 True as its small
      sizes up to 4B, qwen3_moe, mimo, deepseek_v3 and glm4_moe False).
    rope_scaling: written as config.json's `rope_scaling` (e.g. LLAMA31_ROPE_SCALING for a Llama-3.1 shape).
    rope_theta: None = 10000, or 1000000 for qwen3 / qwen3_moe / glm4_moe (their checkpoints').
    head_dim: None = hidden_size / num_heads, or for qwen3 / qwen3_moe / glm4_moe twice that (they size their heads
      apart from the hidden size, so q/o projections are not square); deepseek_v3: its qk_nope / v head dims.
    num_experts / num_experts_per_tok: qwen3_moe, deepseek_v3, glm4_moe; first_k_dense_replace: the dense layers
      before the sparse ones (deepseek_v3, glm4_moe; see `make_config`).
    mtp_layers: mimo, deepseek_v3, glm4_moe (`num_nextn_predict_layers`); the released DeepSeek-V3 / GLM-4.5 have 1.
    The router's `e_score_correction_bias` is written in float32 whatever `dtype`, as their checkpoints store it.
    """
    dtype = canonical_dtype(dtype)
    if arch == "mimo" and mtp_layers < 1:
        raise ValueError(f"mtp_layers={mtp_layers}: a mimo checkpoint needs at least one MTP layer")
    if mtp_layers < 0:
        raise ValueError(f"mtp_layers={mtp_layers}: choose 0 or more")
    vocab_size = full_vocab_size() if vocab_size is None else int(vocab_size)
    if tie_word_embeddings is None:
        tie_word_embeddings = arch in ("qwen2", "qwen3")
    if rope_theta is None:
        rope_theta = 1000000.0 if arch in (*QK_NORM_ARCHS, "glm4_moe") else 10000.0
    if head_dim is None and arch in QK_NORM_ARCHS and hidden_size % num_heads == 0:
        head_dim = 2 * hidden_size // num_heads
    config = make_config(arch, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                         max_position_embeddings=max_position_embeddings, dtype=dtype,
                         mtp_layers=mtp_layers if arch in MTP_ARCHS else 0, tie_word_embeddings=tie_word_embeddings,
                         rope_scaling=rope_scaling, rope_theta=rope_theta, head_dim=head_dim,
                         num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                         first_k_dense_replace=first_k_dense_replace)
    weights = make_weights(config, seed)
    if init_from is not None:
        source = load_file(str(Path(init_from) / "model.safetensors"))
        for name, tensor in source.items():
            if name in weights and weights[name].shape == tensor.shape:
                weights[name] = tensor.float().clone()
            elif name == "model.embed_tokens.weight" and tie_word_embeddings is False \
                    and "lm_head.weight" not in source and weights["lm_head.weight"].shape == tensor.shape:
                weights["lm_head.weight"] = tensor.float().clone()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, indent=2))
    save_file({k: t.to(torch.float32 if k.endswith("e_score_correction_bias") else torch_dtype(dtype)).contiguous()
               for k, t in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out, vocab_size)
    return out


def tiny_draft_vocab(vocab_size: int, draft_vocab_size: int) -> list[int]:
    """The target ids a tiny draft keeps: EOS, <|im_end|> and the first characters (pad, bos and <|im_start|>
    left out, so d2t holds real offsets), ascending as EAGLE3 maps are."""
    dropped = {PAD_ID, BOS_ID, 3}
    kept = [i for i in range(vocab_size) if i not in dropped][:draft_vocab_size]
    if len(kept) != draft_vocab_size or draft_vocab_size < 2:
        raise ValueError(f"draft_vocab_size={draft_vocab_size}: choose 2..{vocab_size - len(dropped)} for a target "
                         f"vocabulary of {vocab_size}")
    return kept


def make_tiny_eagle3_draft(out_dir: str | Path, target_dir: str | Path, draft_vocab_size: int = 48,
                           intermediate_size: int | None = None, aux_layer_ids: list[int] | None = None,
                           seed: int = 1, dtype: str = "float32") -> Path:
    """Write a random EAGLE3 draft for the Llama checkpoint at `target_dir`, in SGLang's
    LlamaForCausalLMEagle3 layout (common/eagle3_draft.py), and return its path.

    aux_layer_ids: None = [0, (L - 1) // 2, L - 2] for a target of L >= 4 layers (SGLang's own default,
      [1, L//2 - 1, L - 4], needs L >= 6 to name three distinct layers), written to
      eagle_config.eagle_aux_hidden_state_layer_ids.
    """
    from slime_spec.common.eagle3_draft import ARCHITECTURE, AUX_IDS_FIELD, Eagle3Draft, save_draft
    target = json.loads((Path(target_dir) / "config.json").read_text())
    if target.get("model_type") != "llama":
        raise ValueError(f"{target_dir}: model_type {target.get('model_type')!r}; EAGLE3 drafts here are for llama")
    layers = target["num_hidden_layers"]
    if aux_layer_ids is None:
        if layers < 4:
            raise ValueError(f"{target_dir} has {layers} layers: an EAGLE3 draft reads three distinct layers "
                             f"0..L-2; make the target with num_layers >= 4")
        aux_layer_ids = [0, (layers - 1) // 2, layers - 2]
    hot = tiny_draft_vocab(target["vocab_size"], draft_vocab_size)
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
            "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id",
            "pad_token_id")
    config = {k: target[k] for k in keep if k in target}
    config.update(architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1,
                  intermediate_size=intermediate_size or target["intermediate_size"],
                  draft_vocab_size=draft_vocab_size, target_hidden_size=target["hidden_size"],
                  tie_word_embeddings=False, torch_dtype=canonical_dtype(dtype),
                  eagle_config={AUX_IDS_FIELD: list(aux_layer_ids), "use_aux_hidden_state": True})
    draft = Eagle3Draft(config, num_aux=len(aux_layer_ids))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        draft.midlayer.self_attn.o_proj.weight.mul_(0.5)
        draft.midlayer.mlp.down_proj.weight.mul_(0.5)
        draft.lm_head.weight.mul_(2.0)
        ids = torch.tensor(hot, dtype=torch.long)
        draft.d2t.copy_(ids - torch.arange(len(hot)))
        draft.t2d.zero_()
        draft.t2d[ids] = True
    return save_draft(draft, out_dir, torch_dtype(canonical_dtype(dtype)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slime-spec make-tiny-model", description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--mtp-layers", type=int, default=1, help="MTP layers (mimo, deepseek_v3, glm4_moe)")
    p.add_argument("--vocab", type=int, default=None, help=f"vocab size (default {full_vocab_size()})")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None,
                   help="per-head dimension (default hidden-size / num-heads; qwen3, qwen3_moe, glm4_moe: twice that)")
    p.add_argument("--num-experts", type=int, default=4, help="routed experts (qwen3_moe, deepseek_v3, glm4_moe)")
    p.add_argument("--num-experts-per-tok", type=int, default=2,
                   help="experts per token (qwen3_moe, deepseek_v3, glm4_moe)")
    p.add_argument("--first-k-dense-replace", type=int, default=1,
                   help="dense layers before the sparse ones (deepseek_v3, glm4_moe)")
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--init-from", default=None, help="copy same-name, same-shape tensors from this checkpoint")
    p.add_argument("--eagle3-draft", default=None, metavar="DIR",
                   help="also write an EAGLE3 draft for the (llama, >= 4 layers) model to DIR")
    p.add_argument("--draft-vocab", type=int, default=48, help="the EAGLE3 draft's vocabulary size")
    p.add_argument("--llama31-rope", action="store_true", help="Llama-3.1 rope_scaling (rope_type llama3)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.eagle3_draft and a.arch != "llama":
        p.error(f"--eagle3-draft needs --arch llama (got {a.arch})")
    path = make_tiny_model(a.out, arch=a.arch, mtp_layers=a.mtp_layers, vocab_size=a.vocab,
                           hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=a.num_heads,
                           num_kv_heads=a.num_kv_heads, intermediate_size=a.intermediate_size,
                           max_position_embeddings=a.max_position_embeddings, seed=a.seed, dtype=a.dtype,
                           init_from=a.init_from, rope_scaling=LLAMA31_ROPE_SCALING if a.llama31_rope else None,
                           head_dim=a.head_dim, num_experts=a.num_experts,
                           num_experts_per_tok=a.num_experts_per_tok, first_k_dense_replace=a.first_k_dense_replace)
    print(f"wrote {a.arch} checkpoint to {path}")
    if a.eagle3_draft:
        draft = make_tiny_eagle3_draft(a.eagle3_draft, path, draft_vocab_size=a.draft_vocab, seed=a.seed + 1,
                                       dtype=a.dtype)
        print(f"wrote EAGLE3 draft to {draft}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
