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

    def megatron(self) -> "_MegatronTimers | None":
        """This timer in the form megatron-core's schedules call theirs (`config.timers(name).start()` and
        `.stop()`): each micro-batch's backward pass there is "trunk backward". None when off."""
        return _MegatronTimers(self) if self.enabled else None


class _MegatronTimers:
    PARTS = {"backward-compute": "trunk backward"}  # megatron-core's timer names -> ours; the rest are not timed

    def __init__(self, timer: PartTimer):
        self.timer = timer
        self.started: dict[str, float] = {}

    def __call__(self, name: str, log_level: int | None = None) -> "_Span":
        return _Span(self, name)


class _Span:
    """What `timers(name)` returns: megatron-core starts and stops a name through two separate calls."""

    def __init__(self, timers: _MegatronTimers, name: str):
        self.timers, self.name, self.part = timers, name, timers.PARTS.get(name)

    def start(self, barrier: bool = False) -> None:
        if self.part is not None:
            _synchronize()
            self.timers.started[self.name] = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        started = self.timers.started.pop(self.name, None)
        if self.part is not None and started is not None:
            _synchronize()
            self.timers.timer.seconds[self.part] += time.perf_counter() - started


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
