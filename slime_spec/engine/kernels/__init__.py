"""Triton kernels for the embedded engine's CUDA decode path (SGLang's names: a low-M `gemv` for
`--bf16-gemm-backend gemv`, a `decode_attention` for `--attention-backend triton`, and `rms_norm` with the residual
add, as SGLang's fused_add_rmsnorm).

A batch-1 decode step of a 0.7B model is bound by reading its weights: cuBLAS's kernels for one row reach a
fraction of the memory bandwidth on 1536-wide matrices, and SDPA needs the keys gathered out of the static
cache first. The kernels read their operands once, in place, and run inside captured CUDA graphs. Triton is
imported lazily: the CPU path never needs it, and tests run the kernels in Triton's interpreter.
"""

from contextlib import contextmanager
from functools import lru_cache

import torch


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, last dim] with unit stride along the last dim (a copy only where it is strided): how the kernels
    index their inputs."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


_dependent = {"on": False}


@contextmanager
def dependent_launches(on: bool):
    """Within: the kernels launch as programmatic dependents (`pdl`). The engine turns it on for the forwards it
    captures (and their warm-ups, so the capture compiles nothing new): in a graph every kernel's predecessor is
    known, and no weight is written between two replays' kernels."""
    before = _dependent["on"]
    _dependent["on"] = on
    try:
        yield
    finally:
        _dependent["on"] = before


def pdl(t: torch.Tensor) -> bool:
    """Whether a kernel on t's device launches with programmatic dependent launch (Hopper and newer, inside
    `dependent_launches`): it may start while the kernel before it finishes, loads its weights (which no kernel of
    the step writes), then waits (`griddepcontrol.wait`) for the previous kernel's writes before it reads
    activations or writes anything, and lets the next kernel start early in turn. At batch 1 most kernels run a few
    microseconds, so each one's ramp-up and tail are a large part of the step."""
    return _dependent["on"] and t.is_cuda and _hopper(t.device.index if t.device.index is not None
                                                      else torch.cuda.current_device())


@lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(t: torch.Tensor) -> dict:
    """A kernel launch's PDL arguments: its PDL constexpr (the kernel waits with gdc_wait), and launch_pdl only where
    on (Triton's interpreter knows no such option)."""
    on = pdl(t)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}
