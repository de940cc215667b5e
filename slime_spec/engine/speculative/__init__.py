"""Speculative decoding in the embedded engine, laid out as SGLang's srt/speculative.

worker.py  `SpecWorker`: one step's draft -> verify -> accept, its counters and step times (tree steps too)
accept.py  how drafts are picked and accepted (greedy, and the lossless rule for sampled rows)
timing.py  `StepTimes` (per-phase totals) and `PhaseClock` (one step's laps)

The drafters themselves are in engine/drafters/, the per-step draft length in engine/speculative/policy.py.
"""

from slime_spec.engine.speculative.accept import accept_drafts, draft_pick
from slime_spec.engine.speculative.timing import PhaseClock, StepTimes
from slime_spec.engine.speculative.worker import SpecWorker, TargetEngine

__all__ = ["PhaseClock", "SpecWorker", "StepTimes", "TargetEngine", "accept_drafts", "draft_pick"]
