"""Acceptance canary: does the draft still agree with the target after a weight sync?

The training loop runs it after every sync, including the full sync a restarted engine gets before
it serves again. In --colocate runs that sync follows the memory resume, so a draft lost on resume
shows here too (with `colocated=True`, `judge_canary` names that cause as well); `event="resume"` is
for a caller that probes right after a resume with no sync in between. A fixed probe (greedy, a few
prompts taken once from the policy's own recent samples, so every canary reads the same inputs) goes
through `/generate`; accept length is summed raw counters, sum(completion_tokens) / sum(spec_verify_ct),
as SGLang's own tests compute it. With speculation on, an accept length of about 1.0 means the draft
proposes nothing the target accepts: the draft is stale or broken, and the likely cause depends on
what just happened (`judge_canary`, pure).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Sequence

from slime_spec.engines.client import EngineClient
from slime_spec.weight_sync.protocol import SpecSetup

logger = logging.getLogger(__name__)

Event = Literal["sync", "resume"]
COLLAPSE_ACCEPT_LENGTH = 1.1  # at most one draft token accepted in ten verify passes
DROP_FRACTION = 0.5  # a fall to half the previous canary's gain over 1.0 is worth a warning


@dataclass(frozen=True)
class CanaryVerdict:
    accept_length: float
    level: Literal["ok", "warning", "error", "off"]
    message: str


def accept_length(meta_infos: Sequence[dict]) -> float:
    """sum(completion_tokens) / sum(spec_verify_ct) over the probe's requests; 1.0 without any verify pass."""
    completion = sum(int(m.get("completion_tokens", 0)) for m in meta_infos)
    verify = sum(int(m.get("spec_verify_ct", 0)) for m in meta_infos)
    return completion / verify if verify else 1.0


RESUME_CAUSE = ("the draft's weights were lost when engine memory was released and resumed (enable "
                "draft-weights CPU backup is not always enough: SGLang PR #31674); re-sync the weights after resume")


def likely_cause(event: Event, spec: SpecSetup, colocated: bool = False) -> str:
    if event == "resume":
        return RESUME_CAUSE
    if colocated and not spec.native_mtp:  # a sync does not rewrite an external draft lost on resume
        return f"{_sync_cause(spec)}; or {RESUME_CAUSE}"
    return _sync_cause(spec)


def _sync_cause(spec: SpecSetup) -> str:
    if spec.native_mtp:
        return ("the MTP draft was not updated with the policy: check that MTP tensors were sent "
                "(weight_sync_mtp_params > 0) with selector 'all' (SGLang < 0.5.23 never updates the draft "
                "through update_weights_from_distributed, sglang#27718)")
    return (f"the external draft ({spec.algorithm}) was overwritten by target tensors (slime#1177: target "
            "updates must use selector 'target'), or the policy drifted far from a frozen draft")


def judge_canary(length: float, spec: SpecSetup, event: Event, previous: float | None = None,
                 colocated: bool = False) -> CanaryVerdict:
    """Pure: the verdict on one canary reading, given what happened just before it."""
    if not spec.uses_draft:
        return CanaryVerdict(length, "off", "speculative decoding is off: no draft to check")
    cause = likely_cause(event, spec, colocated)
    if length <= COLLAPSE_ACCEPT_LENGTH:
        return CanaryVerdict(length, "error", f"spec_canary_accept_length={length:.3f} after {event}: acceptance "
                                              f"collapsed to about 1.0. Likely cause: {cause}")
    if previous is not None and previous > 1.0 and (length - 1.0) < DROP_FRACTION * (previous - 1.0):
        return CanaryVerdict(length, "warning", f"spec_canary_accept_length fell from {previous:.3f} to "
                                                f"{length:.3f} after {event}. Possible cause: {cause}")
    return CanaryVerdict(length, "ok", f"spec_canary_accept_length={length:.3f} after {event}")


class AcceptanceCanary:
    """Holds the fixed probe and the last reading; `run` after each sync."""

    def __init__(self, spec: SpecSetup, *, num_prompts: int = 4, max_new_tokens: int = 32,
                 colocated: bool = False):
        self.spec, self.num_prompts, self.max_new_tokens = spec, num_prompts, max_new_tokens
        self.colocated = colocated
        self.probe: list[list[int]] | None = None
        self.previous: float | None = None
        self.last_verdict: CanaryVerdict | None = None

    def set_probe_from_samples(self, token_lists: Sequence[Sequence[int]]) -> None:
        """Fix the probe once, from the policy's own samples (prompt + response ids); later calls keep it."""
        if self.probe is None and token_lists:
            self.probe = [list(t) for t in token_lists[: self.num_prompts]]

    def run(self, clients: Sequence[EngineClient], event: Event) -> dict:
        """Probe every engine; returns {'spec_canary_accept_length': ...} (the mean over engines)."""
        if self.probe is None:
            raise ValueError("AcceptanceCanary.run before a probe was set: call set_probe_from_samples first")
        lengths = [self._probe_engine(c) for c in clients]
        length = sum(lengths) / len(lengths)
        verdict = self.last_verdict = judge_canary(min(lengths), self.spec, event, self.previous,
                                                      self.colocated)  # the worst engine decides
        if verdict.level == "error":
            logger.error(verdict.message)
        elif verdict.level == "warning":
            logger.warning(verdict.message)
        self.previous = length
        return {"spec_canary_accept_length": length}

    def _probe_engine(self, client: EngineClient) -> float:
        metas = []
        for ids in self.probe:
            reply = client.post("/generate", {"input_ids": ids, "sampling_params": {
                "temperature": 0.0, "max_new_tokens": self.max_new_tokens, "ignore_eos": True}})
            metas.append(reply["meta_info"])
        return accept_length(metas)
