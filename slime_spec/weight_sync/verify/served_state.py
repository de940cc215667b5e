"""What each engine serves, verified by the engine's own checksums, so a failed sync claims only what it saw.

After a failed sync, a reply from the engine ("rolled back", "session closed") is not proof of what it
serves: an engine restarted mid-sync has no session and serves its checkpoint; a stray
`/end_weight_update` leaves the buckets that landed in place. So the syncer keeps, per engine, the
checksums of the last state it verified (the baseline read at prepare(): the checkpoint; then each
verified sync's coverage reply) and, after a failure, reads every engine again (`/weights_checker`,
the engine's own hash, and its `weight_version` from `/model_info`) and compares:

- every checksum equal to the last verified state: serves the previous weights;
- every checksum equal to the checkpoint baseline: serves the checkpoint;
- anything else: a mix (the count of checksums that agree with the last verified state is reported);
- no answer: unreachable (it serves nothing); no `/weights_checker`, no baseline, or a read-back that failed:
  unverified (nothing is claimed about it).

Pure functions except `read_served`; the decision (continue generation or not) is the syncer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slime_spec.fleet.client import EngineClient, EngineError, weight_version_of
from slime_spec.weight_sync import protocol

Serves = Literal["previous", "checkpoint", "mix", "unreachable", "unverified"]


@dataclass(frozen=True)
class ServedState:
    """One engine's served weights as its checksum route reports them (keys `rank:name`, all TP ranks)."""

    weight_version: str | None
    checksums: dict[str, str]


@dataclass(frozen=True)
class EngineVerdict:
    url: str
    serves: Serves
    weight_version: str | None = None
    agree: int = 0  # checksums equal to the last verified state
    total: int = 0  # checksums compared
    reason: str = ""

    def describe(self) -> str:
        version = f"weight_version {self.weight_version!r}"
        counts = f"{self.agree}/{self.total} checksums equal the last verified state"
        if self.serves == "previous":
            return f"{self.url}: serves the previous weights ({version}, {counts})"
        if self.serves == "checkpoint":
            return f"{self.url}: serves the CHECKPOINT it started from, not the previous weights ({version}, {counts})"
        if self.serves == "mix":
            return f"{self.url}: serves a MIX of new and previous weights ({version}, {counts})"
        if self.serves == "unreachable":
            return f"{self.url}: UNREACHABLE, serves nothing ({self.reason})"
        return f"{self.url}: UNVERIFIED ({self.reason})"

    def metrics(self, index: int) -> dict:
        return {f"weight_sync_engine{index}_serves": self.serves,
                f"weight_sync_engine{index}_weight_version": self.weight_version,
                f"weight_sync_engine{index}_checksums_agree": self.agree,
                f"weight_sync_engine{index}_checksums_total": self.total}


def checksums_of(checker_reply: dict) -> dict[str, str]:
    """`/weights_checker` reply -> {`rank:key`: checksum} over every TP rank (a TP shard differs per rank)."""
    ranks = checker_reply.get("ranks")
    if not ranks:
        raise ValueError(f"/weights_checker returned no `ranks` (checksums): {checker_reply.get('message')!r}")
    return {f"{i}:{key}": c for i, info in enumerate(ranks) for key, c in info["checksums"].items()}


def read_served(client: EngineClient, session: bool) -> ServedState | None:
    """The engine's checksums (its own method, every runner) and weight version; None without /weights_checker.

    Raises EngineError when the engine does not answer.
    """
    try:
        reply = client.post("/weights_checker", protocol.checksum_payload("all", session))
    except EngineError as e:
        if e.status == 404:
            return None
        raise
    return ServedState(weight_version_of(client), checksums_of(reply))


def judge(url: str, now: ServedState | None, previous: ServedState | None,
          checkpoint: ServedState | None) -> EngineVerdict:
    """Compare what an engine serves now with the last verified state and the checkpoint baseline."""
    if now is None:
        return EngineVerdict(url, "unverified", reason="the engine has no /weights_checker (SGLang < 0.5.23?), "
                                                       "so what it serves cannot be read back")
    if previous is None and checkpoint is not None and now.checksums == checkpoint.checksums:
        # a restarted engine is recognised even when the last sync was not checksummed
        return EngineVerdict(url, "checkpoint", now.weight_version, 0, len(now.checksums))
    if previous is None:
        return EngineVerdict(url, "unverified", now.weight_version, total=len(now.checksums),
                             reason=f"weight_version {now.weight_version!r}; no verified state to compare with "
                                    "(the last successful sync skipped its check: see --weight-sync-check-interval)")
    agree = sum(now.checksums.get(k) == c for k, c in previous.checksums.items())
    total = len(previous.checksums)
    same_names = set(now.checksums) == set(previous.checksums)
    if same_names and agree == total:
        serves: Serves = "previous"
    elif checkpoint is not None and now.checksums == checkpoint.checksums:
        serves = "checkpoint"
    else:
        serves = "mix"
    return EngineVerdict(url, serves, now.weight_version, agree, total)


def unreachable(url: str, error: BaseException) -> EngineVerdict:
    return EngineVerdict(url, "unreachable", reason=str(error)[:300])


def unread(url: str, error: BaseException) -> EngineVerdict:
    """The engine answers, but reading back what it serves failed: nothing is claimed about it."""
    return EngineVerdict(url, "unverified", reason=f"reading back what it serves failed: {str(error)[:300]}")
