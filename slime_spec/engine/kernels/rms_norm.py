"""RMSNorm, and the residual add before it, in one Triton kernel: what SGLang's `RMSNorm.forward_cuda` gets from
`fused_add_rmsnorm`.

Eagerly, HF's RMSNorm is four kernels (upcast, normalise, downcast, scale by the weight) and the residual add a
fifth. In a decode step each is a launch over a few kilobytes, so in a captured graph the norms of a 24-layer model
cost more than its attention. One program per row here: it adds the residual in the input dtype (as `x + delta`
rounds), writes that sum, and normalises it with float32 statistics, rounding where HF's module rounds.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from slime_spec.engine.kernels import as_rows, pdl_launch


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, delta_ptr, w_ptr, y_ptr, sum_ptr, N, stride_x, stride_delta, stride_y, stride_sum, eps,
                        ADD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # a weight: loaded before the PDL wait
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if ADD:  # h = x + delta, rounded to the input dtype as torch's add rounds it
            x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0).to(tl.float32)
                 ).to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        normed = (xf * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)  # HF: .to(input dtype), then * weight
        tl.store(y_ptr + row * stride_y + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=ok)

    return rms_norm_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(h), h) with h = x + delta, or (RMSNorm(x), None) without delta; HF Llama's RMSNorm (float32
    statistics, the weight applied in the input dtype) over the last dimension, any leading dimensions."""
    import triton

    n = x.shape[-1]
    if weight.shape != (n,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, delta "
                         f"{None if delta is None else tuple(delta.shape)}: "
                         f"the weight must be [{n}] and delta x's shape")
    x2 = as_rows(x)
    d2 = as_rows(delta) if delta is not None else x2
    rows = x2.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if delta is not None else y
    block = triton.next_power_of_2(n)
    _kernel()[(rows,)](x2, d2, weight, y, h, n, x2.stride(0), d2.stride(0), y.stride(0), h.stride(0), eps,
                       ADD=delta is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4, **pdl_launch(x2))
    if delta is None:
        return y.view(x.shape), None
    return y.view(x.shape), h.view(x.shape)
