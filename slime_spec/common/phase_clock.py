"""A wall clock cut into named phases: one speculative engine step's laps, one RL step's parts.

`lap(phase)` charges the seconds since the previous lap (or the start) to `phase`; `phase(name)` charges one
block's seconds. The caller names where each phase ends, so timing stays out of the code it measures.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator


class PhaseClock:
    def __init__(self, start: float | None = None):
        self.start = self.last = time.perf_counter() if start is None else start
        self.seconds: dict[str, float] = defaultdict(float)

    def lap(self, phase: str) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        self.seconds[phase] += seconds
        return seconds

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the block's seconds to `name` (what ran before the block is no phase's)."""
        self.last = time.perf_counter()
        yield
        self.lap(name)

    def since_start(self) -> float:
        """Seconds from the start to the last lap."""
        return self.last - self.start
