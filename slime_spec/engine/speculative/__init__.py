"""Speculative decoding in the embedded engine, laid out as SGLang's srt/speculative.

worker.py       `SpecWorker`: one step's draft -> verify -> accept, its counters and step times (tree steps too)
accept.py       how drafts are picked and accepted (greedy, and the lossless rule for sampled rows)
policy.py       each step's draft length: fixed, SGLang's adaptive, or `--spec-auto`
tree.py         draft trees (`eagle-topk > 1`): expansion, the verify tree, acceptance
tree_graphs.py  the tree steps' CUDA graphs
timing.py       `StepTimes`: per-phase totals of the steps' laps (common/phase_clock.py `PhaseClock`)

The drafters themselves are in engine/drafters/.
"""

from slime_spec.engine.speculative.accept import accept_drafts, draft_pick
from slime_spec.engine.speculative.timing import StepTimes
from slime_spec.engine.speculative.worker import SpecWorker, TargetEngine

__all__ = ["SpecWorker", "StepTimes", "TargetEngine", "accept_drafts", "draft_pick"]
