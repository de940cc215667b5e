"""Where a train step's time goes, per part, for benchmarks (bench/trainer.py).

Off by default: enabled, every part synchronises the GPU before and after, which serialises work a real
step would overlap, so only a benchmark turns it on.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

PARTS = ("old log-probs", "trunk forward", "MTP forward", "MTP loss", "MTP backward", "trunk backward", "optimizer",
         "EAGLE3 draft")  # the online draft's forward, backward and optimizer step (--enable-draft-training)


class PartTimer:
    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, part: str):
        """Add the seconds spent inside the block to `part` (summed over micro-batches and steps)."""
        if part not in PARTS:
            raise ValueError(f"unknown train-step part {part!r}: one of {PARTS}")
        if not self.enabled:
            yield
            return
        _synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize()
            self.seconds[part] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds.clear()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
