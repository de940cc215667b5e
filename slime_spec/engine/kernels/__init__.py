"""Triton kernels for the embedded engine's CUDA decode path (SGLang's names: a low-M `gemv` for
`--bf16-gemm-backend gemv`, a `decode_attention` for `--attention-backend triton`, and `rms_norm` with the residual
add, as SGLang's fused_add_rmsnorm).

A batch-1 decode step of a 0.7B model is bound by reading its weights: cuBLAS's kernels for one row reach a
fraction of the memory bandwidth on 1536-wide matrices, and SDPA needs the keys gathered out of the static
cache first. The kernels read their operands once, in place, and run inside captured CUDA graphs. Triton is
imported lazily: the CPU path never needs it, and tests run the kernels in Triton's interpreter.
"""

import torch


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, last dim] with unit stride along the last dim (a copy only where it is strided): how the kernels
    index their inputs."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
