"""Write a small random HF checkpoint (config.json, model.safetensors, a character-level tokenizer).

Tests, benchmarks and the CPU demo build every model they use with this: no hub access is needed.
The checkpoint is a real Llama / Qwen2 / Qwen3 / Qwen3-MoE / MiMo / DeepSeek-V3 / GLM-4.5 checkpoint by HF names,
loadable by transformers (all but MiMo; transformers reads no MTP layer) and by
`slime_spec.engine.model_executor.model` (the dense
families and Qwen3-MoE). DeepSeek-V3 and GLM-4.5 checkpoints have their released config.json keys and tensor names
(MLA, routed and shared experts with the router's `e_score_correction_bias`, dense-first layers, MTP layers as
`model.layers.{num_hidden_layers + i}`), unquantized unless `fp8` (DeepSeek-V3's block-wise FP8: float8_e4m3fn
projections with float32 `weight_scale_inv` per 128 x 128 block, and its `quantization_config`). Deterministic by
`seed`.

CLI: `slime-spec make-tiny-model --arch llama|qwen2|qwen3|qwen3_moe|mimo|deepseek_v3|glm4_moe|glm4_moe_lite
[--mtp-layers K] [--vocab N] [--fp8] --out DIR`;
`--arch llama|qwen3|qwen3_moe --num-layers 4 --eagle3-draft DRAFT_DIR [--draft-vocab N]` also writes an EAGLE3 draft
for it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from slime_spec.common.dtypes import DTYPES, canonical_dtype, torch_dtype
from slime_spec.tools.tiny_families import (
    ARCHS,
    LLAMA31_ROPE_SCALING,
    MTP_ARCHS,
    QK_NORM_ARCHS,
    make_config,
    make_weights,
)
from slime_spec.tools.tiny_tokenizer import BOS_ID, EOS_ID, PAD_ID, full_vocab_size, write_tokenizer
from slime_spec.weight_sync import fp8 as fp8_format

# The tool's API; the family writers and the tokenizer are in tiny_families.py and tiny_tokenizer.py.
__all__ = ["ARCHS", "BOS_ID", "EOS_ID", "LLAMA31_ROPE_SCALING", "PAD_ID", "full_vocab_size", "main", "make_config",
           "make_tiny_eagle3_draft", "make_tiny_model", "make_weights", "tiny_draft_vocab", "write_tokenizer"]


def make_tiny_model(out_dir: str | Path, arch: str = "llama", mtp_layers: int = 1, vocab_size: int | None = None,
                    hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 128, max_position_embeddings: int = 1024, seed: int = 0,
                    dtype: str = "float32", init_from: str | None = None,
                    tie_word_embeddings: bool | None = None, rope_scaling: dict | None = None,
                    rope_theta: float | None = None, head_dim: int | None = None, num_experts: int = 4,
                    num_experts_per_tok: int = 2, first_k_dense_replace: int = 1, fp8: bool = False) -> Path:
    """Write a random checkpoint to `out_dir` and return its path.

    vocab_size: None = every special token and character (see `full_vocab_size()`); smaller keeps the
      first characters of `tiny_tokenizer.CHARACTERS`; larger adds unused embedding rows.
    init_from: a checkpoint directory; every tensor of the same name and shape is copied from it (e.g. a
      1-layer draft sharing the target's embedding and lm_head, or a MiMo whose base is a given Qwen2).
    tie_word_embeddings: None = the family's usual choice (llama False, qwen2 True, qwen3 True as its small
      sizes up to 4B, qwen3_moe, mimo, deepseek_v3, glm4_moe and glm4_moe_lite False).
    rope_scaling: written as config.json's `rope_scaling` (e.g. LLAMA31_ROPE_SCALING for a Llama-3.1 shape).
    rope_theta: None = 10000, or 1000000 for qwen3 / qwen3_moe / glm4_moe / glm4_moe_lite (their checkpoints').
    head_dim: None = hidden_size / num_heads, or for qwen3 / qwen3_moe / glm4_moe twice that (they size their heads
      apart from the hidden size, so q/o projections are not square); deepseek_v3 / glm4_moe_lite: its qk_nope / v
      head dims.
    num_experts / num_experts_per_tok: qwen3_moe, deepseek_v3, glm4_moe, glm4_moe_lite; first_k_dense_replace: the
      dense layers before the sparse ones (deepseek_v3, glm4_moe, glm4_moe_lite; see `make_config`).
    mtp_layers: mimo, deepseek_v3, glm4_moe, glm4_moe_lite (`num_nextn_predict_layers`); the released DeepSeek-V3 /
      GLM-4.5 / GLM-4.7-Flash have 1.
    The router's `e_score_correction_bias` is written in float32 whatever `dtype`, as their checkpoints store it.
    fp8: quantize the attention and MLP projections as DeepSeek-V3's checkpoint does (weight_sync/fp8.py); SGLang's
      FP8 layers need their in-features to be multiples of 128 (e.g. deepseek_v3 with hidden_size 512,
      intermediate_size 256).
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
        rope_theta = 1000000.0 if arch in (*QK_NORM_ARCHS, "glm4_moe", "glm4_moe_lite") else 10000.0
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
    weights = {k: t.to(torch.float32 if k.endswith("e_score_correction_bias") else torch_dtype(dtype)).contiguous()
               for k, t in weights.items()}
    if fp8:
        config["quantization_config"] = dict(fp8_format.DEEPSEEK_V3_FP8)
        weights = _fp8_weights(weights, fp8_format.Fp8BlockScheme.from_hf_config(config))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, indent=2))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out, vocab_size)
    return out


def _fp8_weights(weights: dict[str, torch.Tensor], scheme) -> dict[str, torch.Tensor]:
    """The checkpoint's projections block-quantized, each followed by its scale."""
    for name, t in weights.items():
        if scheme.quantizes(name) and t.shape[-1] % scheme.block[1]:
            raise ValueError(f"--fp8: {name} has {t.shape[-1]} in-features; SGLang's FP8 layers need multiples of "
                             f"{scheme.block[1]} (e.g. --hidden-size 512 --intermediate-size 256)")
    return dict(fp8_format.quantize_named(weights.items(), scheme))


def tiny_draft_vocab(vocab_size: int, draft_vocab_size: int) -> list[int]:
    """The target ids a tiny draft keeps: EOS, <|im_end|> and the first characters (pad, bos and <|im_start|>
    left out, so d2t holds real offsets), ascending as EAGLE3 maps are."""
    dropped = {PAD_ID, BOS_ID, 3}
    kept = [i for i in range(vocab_size) if i not in dropped][:draft_vocab_size]
    if len(kept) != draft_vocab_size or draft_vocab_size < 2:
        raise ValueError(f"draft_vocab_size={draft_vocab_size}: choose 2..{vocab_size - len(dropped)} for a target "
                         f"vocabulary of {vocab_size}")
    return kept


EAGLE3_TARGETS = ("llama", "qwen3", "qwen3_moe")  # the seeds' EAGLE3 rows: Llama-3.1-8B, Qwen3-235B-A22B


def make_tiny_eagle3_draft(out_dir: str | Path, target_dir: str | Path, draft_vocab_size: int = 48,
                           intermediate_size: int | None = None, aux_layer_ids: list[int] | None = None,
                           seed: int = 1, dtype: str = "float32") -> Path:
    """Write a random EAGLE3 draft for the checkpoint at `target_dir` (a family of EAGLE3_TARGETS), in SGLang's
    LlamaForCausalLMEagle3 layout (common/eagle3_draft.py), and return its path.

    aux_layer_ids: None = [0, (L - 1) // 2, L - 2] for a target of L >= 4 layers (SGLang's own default,
      [1, L//2 - 1, L - 4], needs L >= 6 to name three distinct layers), written to
      eagle_config.eagle_aux_hidden_state_layer_ids.
    """
    from slime_spec.common.eagle3_draft import ARCHITECTURE, AUX_IDS_FIELD, Eagle3Draft, save_draft
    target = json.loads((Path(target_dir) / "config.json").read_text())
    if target.get("model_type") not in EAGLE3_TARGETS:
        raise ValueError(f"{target_dir}: model_type {target.get('model_type')!r}; EAGLE3 drafts here are for "
                         f"{', '.join(EAGLE3_TARGETS)} targets")
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
    p.add_argument("--mtp-layers", type=int, default=1, help="MTP layers (mimo, deepseek_v3, glm4_moe, glm4_moe_lite)")
    p.add_argument("--vocab", type=int, default=None, help=f"vocab size (default {full_vocab_size()})")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None,
                   help="per-head dimension (default hidden-size / num-heads; qwen3, qwen3_moe, glm4_moe: twice that)")
    p.add_argument("--num-experts", type=int, default=4,
                   help="routed experts (qwen3_moe, deepseek_v3, glm4_moe, glm4_moe_lite)")
    p.add_argument("--num-experts-per-tok", type=int, default=2,
                   help="experts per token (qwen3_moe, deepseek_v3, glm4_moe, glm4_moe_lite)")
    p.add_argument("--first-k-dense-replace", type=int, default=1,
                   help="dense layers before the sparse ones (deepseek_v3, glm4_moe, glm4_moe_lite)")
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--init-from", default=None, help="copy same-name, same-shape tensors from this checkpoint")
    p.add_argument("--eagle3-draft", default=None, metavar="DIR",
                   help="also write an EAGLE3 draft for the (llama, qwen3 or qwen3_moe, >= 4 layers) model to DIR")
    p.add_argument("--draft-vocab", type=int, default=48, help="the EAGLE3 draft's vocabulary size")
    p.add_argument("--llama31-rope", action="store_true", help="Llama-3.1 rope_scaling (rope_type llama3)")
    p.add_argument("--fp8", action="store_true",
                   help="block-wise FP8 projections as DeepSeek-V3 ships (in-features multiples of 128)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.eagle3_draft and a.arch not in EAGLE3_TARGETS:
        p.error(f"--eagle3-draft needs --arch {' or '.join(EAGLE3_TARGETS)} (got {a.arch})")
    path = make_tiny_model(a.out, arch=a.arch, mtp_layers=a.mtp_layers, vocab_size=a.vocab,
                           hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=a.num_heads,
                           num_kv_heads=a.num_kv_heads, intermediate_size=a.intermediate_size,
                           max_position_embeddings=a.max_position_embeddings, seed=a.seed, dtype=a.dtype,
                           init_from=a.init_from, rope_scaling=LLAMA31_ROPE_SCALING if a.llama31_rope else None,
                           head_dim=a.head_dim, num_experts=a.num_experts,
                           num_experts_per_tok=a.num_experts_per_tok, first_k_dense_replace=a.first_k_dense_replace,
                           fp8=a.fp8)
    print(f"wrote {a.arch} checkpoint to {path}")
    if a.eagle3_draft:
        draft = make_tiny_eagle3_draft(a.eagle3_draft, path, draft_vocab_size=a.draft_vocab, seed=a.seed + 1,
                                       dtype=a.dtype)
        print(f"wrote EAGLE3 draft to {draft}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
