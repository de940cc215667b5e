"""DeepSeek-V3's multi-latent attention (MLA) for the embedded engine, as SGLang's DeepseekV2AttentionMLA computes it.

Queries come from a low-rank projection (`q_a_proj`, `q_a_layernorm`, `q_b_proj`; or one `q_proj` when the config's
`q_lora_rank` is null). Keys and values come from one compressed latent per token (`kv_a_proj_with_mqa`): its first
`kv_lora_rank` dims, normed by `kv_a_layernorm` and expanded by `kv_b_proj`, give each head's un-rotated key part
(`qk_nope_head_dim`) and its value (`v_head_dim`); its last `qk_rope_head_dim` dims are one rotated key part shared
by every head. Each head's key is `cat(k_nope, k_rope)`, its query `cat(q_nope, q_rope)`.

RoPE is DeepSeek's YaRN (SGLang's `deepseek_yarn`, DeepseekScalingRotaryEmbedding): interpolated low frequencies,
cos/sin scaled by yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim), and the softmax scale
qk_head_dim^-0.5 times yarn_get_mscale(factor, mscale_all_dim)^2 (compute_mla_mscale_scaling). The rotated dims are
interleaved pairs (GPT-J style) unless the config says `rope_interleave: false`, as SGLang reads it.

The cache holds each head's decompressed key and value (`[slots, max_seq, heads, qk_head_dim]` keys,
`[..., v_head_dim]` values): what SGLang's prefill (MHA) path attends over, with the same rounding. SGLang caches the
latent instead (kv_lora_rank + qk_rope_head_dim per token, far smaller) and absorbs kv_b_proj into the query for
decoding; the small models the embedded engine serves do not need that saving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from slime_spec.common.model_families import MLA_FAMILIES, architectures
from slime_spec.engine.kernels.ops import Kernels, linear
from slime_spec.engine.model_executor.attention import fuse_linears
from slime_spec.engine.model_executor.norm import RMSNorm

if TYPE_CHECKING:
    from slime_spec.engine.model_executor.model_args import ModelArgs

MLA_ARCHITECTURES = architectures(MLA_FAMILIES)  # GLM-4.7-Flash: DeepSeek-V3's MLA
YARN_TYPES = ("yarn", "deepseek_yarn")


@dataclass(frozen=True)
class YarnRope:
    """DeepSeek's YaRN parameters (config.json's `rope_scaling`), with SGLang's defaults."""
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    extrapolation_factor: float = 1.0
    attn_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    scale_softmax: bool = True  # rope_scaling's apply_yarn_scaling / apply_scale

    def cos_sin_scale(self) -> float:
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim) \
            * self.attn_factor

    def softmax_scale(self, base: float) -> float:
        return base * yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2 if self.scale_softmax else base

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """float32 [dim / 2]: the extrapolated (original) frequencies above the correction range, the interpolated
        (divided by `factor`) ones below it, a linear blend inside it."""
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        extrapolated = 1.0 / theta ** exponents
        interpolated = extrapolated / self.factor
        low = max(math.floor(self._correction_dim(self.beta_fast, dim, theta)), 0)
        high = min(math.ceil(self._correction_dim(self.beta_slow, dim, theta)), dim - 1)
        if low == high:
            high += 0.001  # as SGLang's yarn_linear_ramp_mask: no division by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = (1 - ramp) * self.extrapolation_factor
        return interpolated * (1 - keep) + extrapolated * keep

    def _correction_dim(self, rotations: float, dim: int, theta: float) -> float:
        """The dim whose wavelength fits `rotations` times in the original context."""
        return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_get_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAArgs:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    yarn: YarnRope | None  # None: plain RoPE over the rope dims
    interleaved: bool  # rotate (x0, x1), (x2, x3), ... pairs (SGLang's is_neox_style=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        base = self.qk_head_dim ** -0.5
        return self.yarn.softmax_scale(base) if self.yarn else base

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, T, qk_rope_head_dim / 2], computed in float32 (YaRN's scale applied) and cast to `dtype`, as
        SGLang's cos_sin_cache."""
        freqs = positions.float()[..., None] * mla_inv_freq_on(positions.device, self)
        scale = self.yarn.cos_sin_scale() if self.yarn else 1.0
        return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


@lru_cache(maxsize=None)
def mla_inv_freq_on(device: torch.device, a: MLAArgs) -> torch.Tensor:
    """The rope dims' inverse frequencies on `device`, computed once (a forward must not copy from the host)."""
    dim = a.qk_rope_head_dim
    if a.yarn is None:
        return (1.0 / a.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).to(device)
    return a.yarn.inv_freq(dim, a.rope_theta).to(device)


def mla_fields(config: dict) -> dict:
    """ModelArgs' attention fields for a DeepSeek-V3 config.json: every head its own key and value."""
    heads = config["num_attention_heads"]
    mla = MLAArgs(q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=int(config["kv_lora_rank"]),
                  qk_nope_head_dim=int(config["qk_nope_head_dim"]), qk_rope_head_dim=int(config["qk_rope_head_dim"]),
                  v_head_dim=int(config["v_head_dim"]), rope_theta=float(rope_theta_of(config)),
                  yarn=yarn_of(config), interleaved=bool(config.get("rope_interleave", True)))
    if mla.qk_rope_head_dim < 2 or mla.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={mla.qk_rope_head_dim}: the embedded engine rotates an even number "
                         "(>= 2) of dims per head; use --rollout-backend sglang")
    return dict(num_kv_heads=heads, head_dim=mla.qk_head_dim, mla=mla)


def rope_theta_of(config: dict) -> float:
    return config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0


def yarn_of(config: dict) -> YarnRope | None:
    """The config's YaRN scaling (`rope_scaling`, or transformers 5's `rope_parameters`), None for plain RoPE."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in YARN_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} in a DeepSeek-V3 config.json: the embedded engine serves MLA "
                         "with plain RoPE or YaRN, as SGLang does; use --rollout-backend sglang")
    fields = {k: float(scaling[k]) for k in ("factor", "beta_fast", "beta_slow", "extrapolation_factor",
                                              "attn_factor", "mscale", "mscale_all_dim") if scaling.get(k) is not None}
    original = scaling.get("original_max_position_embeddings") or config.get("max_position_embeddings", 4096)
    return YarnRope(**fields, original_max_position_embeddings=int(original),
                    scale_softmax=bool(scaling.get("apply_yarn_scaling", True) and scaling.get("apply_scale", True)))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [B, T, H, R]; cos/sin [B, T, R / 2]: RoPE over pairs (x0, x1), (x2, x3), ... when `interleaved`, else over
    the halves (rotate-half)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLAttention(nn.Module):
    """A DeepSeek-V3 layer's `self_attn`, by the checkpoint's names. Runs with a mask (the engine's attention kernel
    serves grouped-query heads only; CausalLM.use_kernels leaves it off)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        m = self.m = a.mla
        self.heads, self.hidden_size = a.num_heads, a.hidden_size
        self.qkv_a: torch.Tensor | None = None  # q_a_proj and kv_a_proj_with_mqa fused (SGLang's fused_qkv_a_proj)
        self.kernels = Kernels()  # CausalLM.use_kernels
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(a.hidden_size, a.num_heads * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(a.hidden_size, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, a.rms_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, a.num_heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(a.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, a.rms_norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, a.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(a.num_heads * m.v_head_dim, a.hidden_size, bias=False)

    def fuse(self) -> None:
        if self.m.q_lora_rank is not None:
            self.qkv_a = fuse_linears([self.q_a_proj, self.kv_a_proj_with_mqa])[0]

    def unfuse(self) -> None:
        self.qkv_a = None

    def _query_and_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = self.m, self.kernels
        if m.q_lora_rank is None:
            return linear(x, self.q_proj.weight, None, k), linear(x, self.kv_a_proj_with_mqa.weight, None, k)
        if self.qkv_a is not None:
            q_a, latent = linear(x, self.qkv_a, None, k).split([m.q_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim],
                                                               dim=-1)
        else:
            q_a, latent = linear(x, self.q_a_proj.weight, None, k), linear(x, self.kv_a_proj_with_mqa.weight, None, k)
        return linear(self.q_a_layernorm(q_a), self.q_b_proj.weight, None, k), latent

    def forward(self, x, cos, sin, cache_k, cache_v, slots, positions, mask, num_keys: int):
        if mask is None:
            raise ValueError("MLA attention runs with a mask: the decode-attention kernel serves grouped-query heads")
        B, T, _ = x.shape
        m, H = self.m, self.heads
        q, latent = self._query_and_latent(x)
        q_nope, q_rope = q.view(B, T, H, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv_a, k_rope = latent.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = linear(self.kv_a_layernorm(kv_a), self.kv_b_proj.weight, None, self.kernels)
        k_nope, v = kv.view(B, T, H, m.qk_nope_head_dim + m.v_head_dim).split([m.qk_nope_head_dim, m.v_head_dim],
                                                                             dim=-1)
        q = torch.cat((q_nope, rotate(q_rope, cos, sin, m.interleaved)), dim=-1)
        k_rope = rotate(k_rope[:, :, None, :], cos, sin, m.interleaved).expand(B, T, H, m.qk_rope_head_dim)
        cache_k[slots[:, None], positions] = torch.cat((k_nope, k_rope), dim=-1)
        cache_v[slots[:, None], positions] = v
        S = mask.shape[-1]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), cache_k[slots, :S].transpose(1, 2),
                                             cache_v[slots, :S].transpose(1, 2), attn_mask=mask,
                                             scale=m.softmax_scale)
        return linear(out.transpose(1, 2).reshape(B, T, H * m.v_head_dim), self.o_proj.weight, None, self.kernels)
