"""The kernels as torch custom ops, and which of them a forward uses (`Kernels`, resolved once from SGLang's flags).

The gemv is a custom op, opaque to torch.compile (`--enable-torch-compile` compiles the decoder layer around it);
the attention kernel writes the KV cache, so compile breaks the graph around it instead. The RMSNorm kernel has no
flag of its own: SGLang's RMSNorm always takes its fused kernel on CUDA. CUDA graphs capture both
like any kernel. Nothing here imports Triton until a kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from slime_spec.engine.kernels.activation import silu_and_mul
from slime_spec.engine.kernels.decode_attention import decode_attention as _decode_attention
from slime_spec.engine.kernels.gemv import gemv as _gemv
from slime_spec.engine.kernels.gemv import serves as gemv_serves
from slime_spec.engine.kernels.rms_norm import rms_norm as _rms_norm

GEMV_BACKENDS = ("auto", "gemv", "cutedsl")  # --bf16-gemm-backend values served by the gemv kernel ("torch": cuBLAS)
SDPA_BACKENDS = ("torch_native", "flex_attention")  # --attention-backend values that keep torch's SDPA


@dataclass(frozen=True)
class Kernels:
    """Which Triton kernels a CUDA forward uses (the engine sets them on CUDA only; the CPU path uses none)."""

    gemv: bool = False       # one-row matmuls of small matrices (gemv.serves; --bf16-gemm-backend)
    attention: bool = False  # RoPE + cache write + causal attention of decode and verify (--attention-backend)
    norm: bool = False       # RMSNorm with the residual add before it (always, as SGLang's fused_add_rmsnorm)
    activation: bool = False  # silu(gate) * up in one kernel (always, as SGLang's SiluAndMul)
    sampling: bool = False   # temperature sampling and its logprobs in one pass per row (--sampling-backend)

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> "Kernels":
        """SGLang's flags -> kernels on a CUDA device: the gemv kernel unless `--bf16-gemm-backend torch`, the
        decode-attention kernel unless torch's SDPA is asked for (`--attention-backend torch_native`, or as the
        decode backend), the RMSNorm and activation kernels, and the sampling kernel unless `--sampling-backend
        pytorch` (which SGLang also picks under `--enable-deterministic-inference`). The embedded engine has no fa3
        or flashinfer: those names get its Triton kernels."""
        decode = values.get("decode_attention_backend") or values.get("attention_backend")
        sampling = values.get("sampling_backend") != "pytorch" and not values.get("enable_deterministic_inference")
        return cls(gemv=(values.get("bf16_gemm_backend") or "auto") in GEMV_BACKENDS,
                   attention=decode not in SDPA_BACKENDS, norm=True, sampling=sampling, activation=True)


@torch.library.custom_op("slime_spec::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False) -> torch.Tensor:
    return _gemv(x, weight, bias, gated=gated)


@gemv_op.register_fake
def _(x, weight, bias, gated=False):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("slime_spec::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps)[0]


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("slime_spec::add_rms_norm", mutates_args=())
def add_rms_norm_op(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + delta), x + delta): a decoder layer's residual add and the norm after it (kernels.rms_norm)."""
    return _rms_norm(x, weight, eps, delta)


@add_rms_norm_op.register_fake
def _(x, delta, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, num_keys: int, heads: int,
                     kv_heads: int) -> torch.Tensor:
    """The fused RoPE + cache write + attention kernel, outside torch.compile: it writes the KV cache, a mutation of
    the compiled layer's inputs that a graph break keeps plain (no functionalised copy of the cache); a captured CUDA
    graph records it like any kernel. Eager calls skip the compiler's wrapper (host time, as `rms_norm`)."""
    if torch.compiler.is_compiling():
        return _compiled_graph_break(qkv, cos, sin, cache_k, cache_v, slots, positions, num_keys, heads, kv_heads)
    return _decode_attention(qkv, cos, sin, cache_k, cache_v, slots, positions, num_keys, heads, kv_heads)


_compiled_graph_break = torch.compiler.disable(_decode_attention)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm kernel: its custom op under torch.compile, else the kernel itself. A custom op's dispatch (the
    autograd and dispatcher layers) costs the host tens of microseconds a call, which eager forwards (a prefill, a
    draft's catch-up) pay 49 times; a replayed graph pays nothing either way."""
    if torch.compiler.is_compiling():
        return rms_norm_op(x, weight, eps)
    return _rms_norm(x, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_op, called directly outside torch.compile (as `rms_norm`)."""
    if torch.compiler.is_compiling():
        return add_rms_norm_op(x, delta, weight, eps)
    return _rms_norm(x, weight, eps, delta)


def _gemv_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False) -> torch.Tensor:
    """gemv_op, called directly outside torch.compile (as `rms_norm`)."""
    if torch.compiler.is_compiling():
        return gemv_op(x, weight, bias, gated=gated)
    return _gemv(x, weight, bias, gated=gated)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: Kernels) -> torch.Tensor:
    """F.linear, through the gemv kernel where `kernels.gemv` and it serves the shape."""
    if kernels.gemv and gemv_serves(x.numel() // x.shape[-1], weight.shape[0], weight.shape[1]):
        return _gemv_call(x, weight, bias)
    return F.linear(x, weight, bias)


def gated_linear(gate_up: torch.Tensor, weight: torch.Tensor, kernels: Kernels) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight) of a fused gate/up output [..., 2I] (the MLP's down projection); the gemv
    kernel applies the activation as it loads, where it serves the shape."""
    if kernels.gemv and gemv_serves(gate_up.numel() // gate_up.shape[-1], weight.shape[0], weight.shape[1]):
        return _gemv_call(gate_up, weight, None, gated=True)
    if kernels.activation and not torch.compiler.is_compiling():  # compiled: inductor fuses the two itself
        return F.linear(silu_and_mul(gate_up), weight)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight)
