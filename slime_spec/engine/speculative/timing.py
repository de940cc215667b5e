"""Where a speculative engine's step time goes: per-phase totals of the steps' `PhaseClock` laps."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from slime_spec.common.phase_clock import PhaseClock


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


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a measured step holds its own device time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
