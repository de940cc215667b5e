"""Host values to the device without stalling the stream, and device results back without waiting for later work.

`torch.tensor(values, device="cuda")` copies from pageable memory, and PyTorch then waits for the stream: every
kernel queued before it must finish first. A speculative step builds a dozen small index tensors (slots,
positions, accepted counts); each such copy left the GPU idle while the host caught up. Copied from pinned memory
with non_blocking=True, a copy is only queued behind the work already launched (the caching host allocator keeps
the pinned buffer alive until the copy has run).
"""

from __future__ import annotations

from typing import Callable

import torch


def device_tensor(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`; on CUDA through a pinned, non-blocking copy."""
    t = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def start_read_back(t: torch.Tensor) -> Callable[[], list]:
    """Queue t's copy to the host; returns a function that waits for that copy alone and gives t.tolist(). On CUDA
    the copy goes to pinned memory behind an event, so work queued after it (a drafter's extend and its next chain)
    runs on the device while the host takes the values and does its bookkeeping; `tolist` on the device tensor
    would wait for that work too."""
    if t.device.type != "cuda":
        return t.tolist
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> list:
        copied.synchronize()
        return host.tolist()

    return wait
