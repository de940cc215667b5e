"""Host values to the device without stalling the stream.

`torch.tensor(values, device="cuda")` copies from pageable memory, and PyTorch then waits for the stream: every
kernel queued before it must finish first. A speculative step builds a dozen small index tensors (slots,
positions, accepted counts); each such copy left the GPU idle while the host caught up. Copied from pinned memory
with non_blocking=True, a copy is only queued behind the work already launched (the caching host allocator keeps
the pinned buffer alive until the copy has run).
"""

from __future__ import annotations

import torch


def device_tensor(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`; on CUDA through a pinned, non-blocking copy."""
    t = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
