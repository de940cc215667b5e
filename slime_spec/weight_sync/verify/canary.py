"""Acceptance canary: does the draft agree with the target as well after a weight sync as before it?

The training loop runs it around every sync, including the full sync a restarted engine gets before it serves
again. A fixed probe (greedy, a few prompts taken once from the policy's own recent samples) goes through
`/generate` on every engine; accept length is token-weighted, sum(completion_tokens) / sum(spec_verify_ct)
(speculative/stats.py), as SGLang's own tests compute it. The reading before a sync is the one taken on the
weights that sync replaces: before the first sync a probe of its own, later the previous sync's reading (the
same prompts, greedy, the same weights). `judge_canary` (pure) compares the two:
- acceptance at about 1.0 before and after: the draft proposes nothing the target accepts yet (a fresh MTP layer,
  a random draft): an untrained draft, said once, never a collapse;
- acceptance fell: the draft's update is blamed only where the sync's own record says so (it sent no draft
  tensors); where the sync verified which tensors the draft runner holds (its coverage check), the fall is the new
  weights' (the draft lags the policy); where it did not, the message says the cause was not verified.
In --colocate runs the sync follows the memory resume, so a draft lost on resume shows here too (`colocated`);
`event="resume"` is for a caller that probes right after a resume with no sync in between.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Sequence

from slime_spec.fleet.client import EngineClient
from slime_spec.speculative.stats import SpecStats
from slime_spec.weight_sync.protocol import SpecSetup

logger = logging.getLogger(__name__)

Event = Literal["sync", "resume"]
COLLAPSE_ACCEPT_LENGTH = 1.1  # at most one draft token accepted in ten verify passes
DROP_FRACTION = 0.5  # a fall to half the gain over 1.0 of the reading before is a fall


@dataclass(frozen=True)
class CanaryVerdict:
    accept_length: float
    level: Literal["ok", "untrained", "warning", "error", "off"]
    message: str


@dataclass(frozen=True)
class SyncRecord:
    """What the sync itself recorded about the draft: the draft tensors it sent (MTP layers, or a trained separate
    draft's), and whether its coverage check read which tensors each runner serves."""

    draft_tensors_sent: int
    coverage_checked: bool

    @classmethod
    def from_metrics(cls, metrics: dict) -> "SyncRecord":
        return cls(int(metrics.get("weight_sync_mtp_params", 0)) + int(metrics.get("weight_sync_draft_params", 0)),
                   bool(metrics.get("weight_sync_covered", 0)))


def accept_length(meta_infos: Sequence[dict]) -> float:
    """Token-weighted accept length over the probe's requests (speculative/stats.py); 1.0 without any verify pass."""
    return SpecStats.total(SpecStats.from_meta_info(m) for m in meta_infos).accept_length


RESUME_CAUSE = ("the draft's weights were lost when engine memory was released and resumed (enable "
                "draft-weights CPU backup is not always enough: SGLang PR #31674); re-sync the weights after resume")


def fall_cause(event: Event, spec: SpecSetup, record: SyncRecord | None, colocated: bool = False) -> tuple[bool, str]:
    """(blamed, cause) of a fall in acceptance: `blamed` only where the sync's record shows the draft was not
    updated, or where a resume (not a sync) preceded it."""
    if event == "resume":
        return True, RESUME_CAUSE
    resume = f"; or {RESUME_CAUSE}" if colocated and not spec.native_mtp else ""
    if spec.native_mtp:
        if record is not None and record.draft_tensors_sent == 0:
            return True, ("the MTP draft was not updated with the policy: the sync sent no MTP tensors "
                          "(weight_sync_mtp_params=0); send them with selector 'all' (SGLang < 0.5.23 never updates "
                          "the draft through update_weights_from_distributed, sglang#27718)")
        if record is not None and record.coverage_checked:
            return False, (f"the sync wrote and verified every tensor the MTP draft serves "
                           f"({record.draft_tensors_sent} sent): the new weights themselves agree less with "
                           "the draft (the policy moved faster than the MTP layer learned)")
        return False, ("this sync did not verify which tensors the draft runner holds (see "
                       "--weight-sync-check-interval): whether the MTP draft was updated is not known")
    if record is not None and record.coverage_checked:
        return False, (f"the sync verified the external draft ({spec.algorithm}) kept its own weights: the policy "
                       f"drifted away from the frozen draft{resume}")
    return False, (f"the external draft ({spec.algorithm}) may have been overwritten by target tensors (slime#1177: "
                   f"target updates must use selector 'target'; not verified this sync), or the policy drifted "
                   f"from the frozen draft{resume}")


def judge_canary(length: float, spec: SpecSetup, event: Event, before: float | None = None,
                 colocated: bool = False, record: SyncRecord | None = None) -> CanaryVerdict:
    """Pure: the verdict on the reading `length` after `event`, against `before`, the reading on the same probe
    and the weights the event replaced; `record`: what the sync recorded about the draft."""
    if not spec.uses_draft:
        return CanaryVerdict(length, "off", "speculative decoding is off: no draft to check")
    if length <= COLLAPSE_ACCEPT_LENGTH and (before is None or before <= COLLAPSE_ACCEPT_LENGTH):
        was = f"{before:.3f} before, " if before is not None else ""
        return CanaryVerdict(length, "untrained", (
            f"spec_canary_accept_length={length:.3f} after {event} ({was}about 1.0): the draft proposes nothing the "
            "target accepts yet, as an untrained draft does (a fresh MTP layer, a random draft); with online "
            "training it rises as the draft learns"))
    fell = before is not None and before > 1.0 and (length - 1.0) < DROP_FRACTION * (before - 1.0)
    if not fell:
        return CanaryVerdict(length, "ok", f"spec_canary_accept_length={length:.3f} after {event}"
                                           + (f" ({before:.3f} before)" if before is not None else ""))
    blamed, cause = fall_cause(event, spec, record, colocated)
    collapsed = length <= COLLAPSE_ACCEPT_LENGTH
    what = "collapsed to about 1.0" if collapsed else "fell"
    level = "error" if blamed and collapsed else "warning"
    return CanaryVerdict(length, level, f"spec_canary_accept_length {what} after {event}: {before:.3f} before, "
                                        f"{length:.3f} after, on the same prompts. "
                                        f"{'Cause: ' if blamed else ''}{cause[0].upper()}{cause[1:]}")


class AcceptanceCanary:
    """Holds the fixed probe and the last reading; `read_before` ahead of a sync, `run` after it."""

    def __init__(self, spec: SpecSetup, *, num_prompts: int = 4, max_new_tokens: int = 32,
                 colocated: bool = False):
        self.spec, self.num_prompts, self.max_new_tokens = spec, num_prompts, max_new_tokens
        self.colocated = colocated
        self.probe: list[list[int]] | None = None
        self.previous: float | None = None  # the last reading: what the engines' current weights give
        self.last_verdict: CanaryVerdict | None = None
        self.untrained_reported = False

    def set_probe_from_samples(self, token_lists: Sequence[Sequence[int]]) -> None:
        """Fix the probe once, from the policy's own samples (prompt + response ids); later calls keep it."""
        if self.probe is None and token_lists:
            self.probe = [list(t) for t in token_lists[: self.num_prompts]]

    def read_before(self, clients: Sequence[EngineClient]) -> None:
        """Ahead of a sync: the reading on the weights it replaces. Only the first needs a probe; afterwards the
        previous reading is that (same probe, greedy, the same weights)."""
        if self.probe is not None and self.previous is None:
            self.previous = self._read(clients)[0]

    def run(self, clients: Sequence[EngineClient], event: Event, sync_metrics: dict | None = None) -> dict:
        """Probe every engine; returns spec_canary_accept_length (the mean over engines) and the reading before."""
        if self.probe is None:
            raise ValueError("AcceptanceCanary.run before a probe was set: call set_probe_from_samples first")
        length, worst = self._read(clients)
        before = self.previous
        record = SyncRecord.from_metrics(sync_metrics) if sync_metrics is not None else None
        verdict = self.last_verdict = judge_canary(worst, self.spec, event, before, self.colocated,
                                                   record)  # the worst engine decides
        if verdict.level == "error":
            logger.error(verdict.message)
        elif verdict.level == "warning":
            logger.warning(verdict.message)
        elif verdict.level == "untrained" and not self.untrained_reported:
            logger.warning(verdict.message)  # once: it stays true until the draft learns
            self.untrained_reported = True
        self.previous = length
        out = {"spec_canary_accept_length": length}
        if before is not None:
            out["spec_canary_accept_length_before"] = before
        return out

    def _read(self, clients: Sequence[EngineClient]) -> tuple[float, float]:
        """(mean, lowest) accept length over the engines."""
        lengths = [self._probe_engine(c) for c in clients]
        return sum(lengths) / len(lengths), min(lengths)

    def _probe_engine(self, client: EngineClient) -> float:
        # one batched /generate (SGLang's list-of-prompts form): the prompts decode together, not one after another
        replies = client.post("/generate", {"input_ids": self.probe, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": self.max_new_tokens, "ignore_eos": True}})
        return accept_length([r["meta_info"] for r in replies["result"]])  # a JSON list (client.parse_response)
