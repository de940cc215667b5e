"""RoPE inverse frequencies from an HF config: plain RoPE and Llama-3.1's "llama3" scaling.

Llama-3.1 stretches the low frequencies of RoPE by `factor` (wavelengths longer than
original_max_position_embeddings / low_freq_factor), keeps the high ones (shorter than
original_max_position_embeddings / high_freq_factor), and blends linearly in between: the rule
transformers applies (`rope_type: llama3`) and SGLang serves. Megatron's own `rope_scaling` hard-codes
factor 8 / 1 / 4 / 8192, so the trainer computes the table here from the checkpoint's numbers (the embedded
engine computes its own with the same functions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str  # "default" | "llama3"
    llama3: dict[str, float] | None = None  # the LLAMA3_FIELDS, when rope_type == "llama3"


def rope_spec(hf_config: dict) -> RopeSpec:
    """The RoPE an HF config asks for (old `rope_scaling` or new `rope_parameters` spelling)."""
    scaling = hf_config.get("rope_scaling") or {}
    params = hf_config.get("rope_parameters") or {}
    merged = {**params, **scaling}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    theta = float(hf_config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if rope_type == "default":
        return RopeSpec(theta, "default")
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} in the HF config is not supported by the trainer "
                         f"(plain RoPE or rope_type 'llama3')")
    missing = [k for k in LLAMA3_FIELDS if k not in merged]
    if missing:
        raise ValueError(f"rope_scaling of type 'llama3' lacks {missing} in the HF config.json; add them "
                         f"(Llama-3.1 uses factor 8, low_freq_factor 1, high_freq_factor 4, "
                         f"original_max_position_embeddings 8192)")
    return RopeSpec(theta, "llama3", {k: float(merged[k]) for k in LLAMA3_FIELDS})


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_scale(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                 original_max_position_embeddings: float) -> torch.Tensor:
    """Llama-3.1's piecewise rescaling of RoPE inverse frequencies."""
    long_wavelen = original_max_position_embeddings / low_freq_factor
    short_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > long_wavelen, inv_freq / factor, inv_freq)
    blend = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_between = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(in_between, blended, scaled)


def inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """float32 inverse frequencies [head_dim / 2] for `spec`."""
    base = default_inv_freq(head_dim, spec.theta)
    if spec.rope_type == "llama3":
        return llama3_scale(base, **spec.llama3)
    return base


def head_dim_of(hf_config: dict) -> int:
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
