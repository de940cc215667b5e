"""The kernels as torch custom ops, and which of them a forward uses (`Kernels`, resolved once from SGLang's flags).

As custom ops they are opaque to torch.compile (`--enable-torch-compile` compiles the decoder layer around them)
and captured like any other kernel in a CUDA graph. Registering them imports no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from slime_spec.engine.kernels.decode_attention import decode_attention as _decode_attention
from slime_spec.engine.kernels.gemv import gemv as _gemv
from slime_spec.engine.kernels.gemv import serves as gemv_serves

GEMV_BACKENDS = ("auto", "gemv", "cutedsl")  # --bf16-gemm-backend values served by the gemv kernel ("torch": cuBLAS)
SDPA_BACKENDS = ("torch_native", "flex_attention")  # --attention-backend values that keep torch's SDPA


@dataclass(frozen=True)
class Kernels:
    """Which Triton kernels a CUDA forward uses; the CPU path uses none."""

    gemv: bool = False       # one-row matmuls of small matrices (gemv.serves; --bf16-gemm-backend)
    attention: bool = False  # causal attention read in place from the KV cache (--attention-backend)

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> "Kernels":
        """SGLang's flags -> kernels on a CUDA device: the gemv kernel unless `--bf16-gemm-backend torch`, the
        decode-attention kernel unless torch's SDPA is asked for (`--attention-backend torch_native`, or as the
        decode backend). The embedded engine has no fa3 or flashinfer: those names get its Triton kernel."""
        decode = values.get("decode_attention_backend") or values.get("attention_backend")
        return cls(gemv=(values.get("bf16_gemm_backend") or "auto") in GEMV_BACKENDS,
                   attention=decode not in SDPA_BACKENDS)

    def on(self, device: torch.device) -> "Kernels":
        """The kernels that apply on `device` (none off CUDA)."""
        return self if device.type == "cuda" else Kernels()


@torch.library.custom_op("slime_spec::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _gemv(x, weight, bias)


@gemv_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("slime_spec::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                        positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    return _decode_attention(q, cache_k, cache_v, slots, positions, num_keys)


@decode_attention_op.register_fake
def _(q, cache_k, cache_v, slots, positions, num_keys):
    return torch.empty_like(q)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: Kernels) -> torch.Tensor:
    """F.linear, through the gemv kernel where `kernels.gemv` and it serves the shape."""
    if kernels.gemv and gemv_serves(x.numel() // x.shape[-1], weight.shape[0], weight.shape[1]):
        return gemv_op(x, weight, bias)
    return F.linear(x, weight, bias)
