"""y = x @ W.T (+ b) for a few rows of x: SGLang's `--bf16-gemm-backend gemv`, in Triton.

A decode step multiplies one row (or k + 1 rows in a verify) by each weight matrix, so the step's time is the
time to read the weights. cuBLAS picks GEMM tiles for this shape that leave most of the memory bandwidth unused
on matrices 1536 wide (0.25-1.2 TB/s measured on an H100 against a 3 TB/s copy). This kernel gives each program
`block_n` output columns: it loads that tile of W once, in `block_k`-wide chunks, and multiplies it with each row
of x in turn (rows unrolled, so the tile is read from HBM once for all of them), accumulating in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from slime_spec.engine.kernels import as_rows, pdl_launch

MAX_ROWS = 8  # the kernel's limit: rows are unrolled, one accumulator each
SERVED_MAX_N = 4096  # the engine routes matmuls of at most SERVED_MAX_ROWS rows and this many outputs here (`serves`)
SERVED_MAX_ROWS = 2


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int


def gemv_config(rows: int, n: int, k: int) -> GemvConfig:
    """Tiles for (rows, N, K), from the tile sweep of bench/kernels_gpu.py on an H200: as few columns per program as
    there are rows (1 or 2, up to 4), the whole row of K (up to 2048) in one chunk, so each program has many 16-byte
    loads in flight. Registers hold the W tile (block_n x block_k) and one row of x at a time."""
    return GemvConfig(block_n=min(4, _pow2(rows)), block_k=min(2048, max(64, _pow2(k))), num_warps=4)


def serves(rows: int, n: int, k: int) -> bool:
    """Where the engine uses the kernel: 1 or 2 rows (a decode at batch 1 or 2, a k = 1 verify) into at most
    SERVED_MAX_N outputs (q/k/v, o_proj, down_proj of a 0.7B model), where cuBLAS's kernels are latency-bound
    (1.3-2.0x slower on an H200). On wider outputs (gate_up, lm_head) cuBLAS is as fast or faster, and from 4 rows
    on this kernel's per-row reductions make it slower: its time grows with the rows (bench/kernels_gpu.py)."""
    return rows <= SERVED_MAX_ROWS and n <= SERVED_MAX_N


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                    GATED: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # row m's sums in acc[m]
        # The first chunk of W is loaded before waiting for the previous kernel (PDL): no kernel writes weights.
        w_first = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :],
                          other=0.0, eviction_policy="evict_first")
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            w = w_first.to(tl.float32)
            if k0 > 0:
                w = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                            other=0.0, eviction_policy="evict_first").to(tl.float32)
            for m in tl.static_range(ROWS):
                xs = x_ptr + m * stride_xm + k0 + rk
                x = tl.load(xs, mask=k_ok, other=0.0).to(tl.float32)
                if GATED:  # x holds [gate | up]: the input is silu(gate) * up
                    x = x / (1.0 + tl.exp(-x)) * tl.load(xs + K, mask=k_ok, other=0.0).to(tl.float32)
                part = tl.sum(w * x[None, :], axis=1)
                acc = tl.where(rm[:, None] == m, acc + part[None, :], acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm < ROWS)[:, None] & n_ok[None, :])

    return gemv_kernel


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, gated: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) for x with at most MAX_ROWS rows (all leading dimensions flattened).
    gated: x is [..., 2K], gate then up (a fused gate/up projection's output), and the input is silu(gate) * up:
    the MLP's activation read in the down projection's loads, not a kernel of its own."""
    import triton

    k = x.shape[-1] // 2 if gated else x.shape[-1]
    n = weight.shape[0]
    x2 = as_rows(x)
    rows = x2.shape[0]
    if rows > MAX_ROWS or weight.stride(-1) != 1 or weight.shape[1] != k:
        raise ValueError(f"gemv: x {tuple(x.shape)} weight {tuple(weight.shape)} stride {weight.stride()}: needs at "
                         f"most {MAX_ROWS} rows and a row-major weight of matching width")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    c = config or gemv_config(rows, n, k)
    _kernel()[(triton.cdiv(n, c.block_n),)](
        x2, weight, bias if bias is not None else weight, y, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, ROWS=rows, BLOCK_M=_pow2(rows), BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, num_warps=c.num_warps, **pdl_launch(x))
    return y.view(*x.shape[:-1], n)
