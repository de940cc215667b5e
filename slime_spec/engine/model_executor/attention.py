"""Grouped-query attention (Llama, Qwen2/3, MiMo, GLM-4.5) and the static KV cache every family's attention writes.

The KV cache is static: one row per request slot, `[slots, max_seq, kv_heads, head_dim]` per layer (values may have
a head size of their own: DeepSeek-V3's MLA, engine/model_executor/mla.py). A forward takes `slots` (which rows),
`positions` `[B, T]` (each row starts at its own cache length) and writes its keys/values at those positions; queries
attend to every key at a position <= their own. Rolling back rejected draft tokens is just resetting the row's
length: stale entries past it are overwritten before any query can see them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from slime_spec.engine.kernels.ops import Kernels, decode_attention, linear
from slime_spec.engine.model_executor.norm import RMSNorm

if TYPE_CHECKING:
    from slime_spec.engine.model_executor.model_args import ModelArgs


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [B, T, R]: rotate-half RoPE over the first R <= D dims, the rest passed through."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class KVCache:
    """Static per-slot keys/values for a stack of layers: `[slots, max_seq, kv_heads, head_dim]` each (values
    `v_head_dim` wide where that differs)."""

    def __init__(self, num_layers: int, slots: int, max_seq: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, v_head_dim: int | None = None):
        self.max_seq = max_seq
        self.k = [torch.zeros((slots, max_seq, kv_heads, head_dim), dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self.v = [torch.zeros((slots, max_seq, kv_heads, v_head_dim or head_dim), dtype=dtype, device=device)
                  for _ in range(num_layers)]


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) into one tensor and make each linear's parameters views
    of it: one matmul then serves them all, and an in-place update of any parameter lands in the fused tensor."""
    weight = torch.cat([lin.weight.data for lin in linears])
    bias = torch.cat([lin.bias.data for lin in linears]) if linears[0].bias is not None else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[start:start + rows]
        if bias is not None:
            lin.bias.data = bias[start:start + rows]
        start += rows
    return weight, bias


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fused q/k/v (CausalLM.fuse_projections)
        self.kernels = Kernels()  # CausalLM.use_kernels
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def fuse(self) -> None:
        """One matmul for q, k and v (CausalLM.fuse_projections)."""
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def unfuse(self) -> None:
        self.qkv = None

    def normed_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, T, heads, D], k [B, T, kv_heads, D] through Qwen3's per-head norms (unchanged without them)."""
        if not self.a.qk_norm:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def forward(self, x, cos, sin, cache_k, cache_v, slots, positions, mask, num_keys: int):
        """mask None: RoPE, the cache write and causal attention over the first `num_keys` keys in one kernel
        (kernels.decode_attention)."""
        B, T, _ = x.shape
        a = self.a
        if mask is None:  # the kernel reads q, k and v from the fused projection's one tensor
            qkv = linear(x, *self.qkv, self.kernels) if self.qkv is not None else torch.cat(
                (self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
            if a.qk_norm:  # the kernel rotates what it reads: normalize q and k first, as SGLang's apply_qk_norm
                q, k, v = qkv.split([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim,
                                     a.num_kv_heads * a.head_dim], dim=-1)
                q, k = self.normed_qk(q.reshape(B, T, a.num_heads, a.head_dim),
                                      k.reshape(B, T, a.num_kv_heads, a.head_dim))
                qkv = torch.cat((q.reshape(B, T, -1), k.reshape(B, T, -1), v), dim=-1)
            out = decode_attention(qkv, cos, sin, cache_k, cache_v, slots, positions, num_keys, a.num_heads,
                                   a.num_kv_heads)
            return linear(out.reshape(B, T, a.num_heads * a.head_dim), self.o_proj.weight, None, self.kernels)
        if self.qkv is not None:
            q, k, v = linear(x, *self.qkv, self.kernels).split(
                [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k = self.normed_qk(q.reshape(B, T, a.num_heads, a.head_dim), k.reshape(B, T, a.num_kv_heads, a.head_dim))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(B, T, a.num_kv_heads, a.head_dim)
        cache_k[slots[:, None], positions] = k
        cache_v[slots[:, None], positions] = v
        S = mask.shape[-1]
        keys = cache_k[slots, :S].transpose(1, 2)
        values = cache_v[slots, :S].transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=a.num_heads != a.num_kv_heads)
        return linear(out.transpose(1, 2).reshape(B, T, a.num_heads * a.head_dim), self.o_proj.weight, None,
                      self.kernels)
