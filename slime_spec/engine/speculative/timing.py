"""Where a speculative engine's step time goes: per-phase totals, and the clock one step charges them with."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch


@dataclass
class StepTimes:
    """Seconds the speculative engine's steps spent per phase since start, for the time shares the rollout reports:
    draft (the drafter proposing, its catch-up after plain steps and the prefill (`SpecWorker.catch_up`) and its
    update after each verify), verify (the target forward and lm_head over every drafted position), sampling
    (acceptance, sampling, appending tokens) and plain (whole k = 0 steps that adaptive or auto speculation chose,
    an overlapped one's read-back at the next speculative step included). On CUDA these are host-side times: a
    chain step waits for the device only at its one read-back, in the sampling phase, so the device time of
    drafting and of the verify forward lands in sampling. Under --spec-auto a step also syncs once at its end, so
    each step's total (what the policy compares per k) holds its own device work and no other step's (a sync
    between phases would leave the device idle while the host launches the next phase)."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    sampling_s: float = 0.0
    plain_s: float = 0.0

    def add(self, clock: "PhaseClock") -> None:
        """Add one step's laps, by phase name (draft, verify, sampling, plain)."""
        for phase, seconds in clock.seconds.items():
            setattr(self, f"{phase}_s", getattr(self, f"{phase}_s") + seconds)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class PhaseClock:
    """One step's wall time cut into laps: `lap(phase)` charges the seconds since the previous lap (or the start)
    to `phase` and returns them. Keeps timing out of the step's logic: the step names where each lap ends."""

    def __init__(self, start: float | None = None):
        self.start = self.last = time.perf_counter() if start is None else start
        self.seconds: dict[str, float] = defaultdict(float)

    def lap(self, phase: str) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        self.seconds[phase] += seconds
        return seconds

    def since_start(self) -> float:
        """Seconds from the start to the last lap."""
        return self.last - self.start


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a measured step holds its own device time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
