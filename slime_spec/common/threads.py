"""Torch's intra-op thread count, set for a block and restored after it."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Run the block on `n` intra-op threads (None: leave torch's setting). Small or memory-bound CPU work on a
    shared machine runs faster on fewer threads: OpenMP workers spin-waiting for a busy core cost more than
    they gain (engine/managers/engine_core.py, engine/weights/receive.py and weight_sync/report.py say what was
    measured)."""
    if n is None:
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
