"""What one sync reports: its time split by phase (trainer, HTTP, engine), its throughput and checks.

`Clock` accumulates the phases while the sync runs; `SyncReport.metrics()` gives the keys of the metrics
JSONL and the console line.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterable

from slime_spec.common.threads import intra_op_threads


@dataclass(frozen=True)
class SyncSplit:
    """Where a sync's time went (seconds): the part the trainer does and the part the engines do are apart."""

    gather_convert_s: float = 0.0  # trainer: TP gather, Megatron -> HF conversion, bucketing (the tensor stream)
    control_s: float = 0.0  # HTTP control requests: pause, begin, end, (group set-up), not the update requests
    send_s: float = 0.0  # update requests: HTTP + wire + engine-side load, as the trainer waits for them, and the
    # staging of each bucket (which overlaps the bucket in flight)
    flush_s: float = 0.0  # /flush_cache; 0 where the last update flushed (its time then in send_s)
    check_s: float = 0.0  # coverage (and value) check after the sync; 0 when skipped
    # inside send_s, as the embedded engine reports it (slime_spec_engine_timing; 0 on SGLang): the slowest
    # engine's seconds receiving bytes (the wire, and the wait for the sender) and loading them
    engine_receive_s: float = 0.0
    engine_load_s: float = 0.0
    engine_snapshot_s: float = 0.0  # inside engine_load_s: the rollback snapshot, which SGLang does not make
    # inside send_s, on the trainer's side: rank 0 waiting in the per-rank bucket exchange for the other colocated
    # trainer ranks' entries (colocated.RankBuckets.wait_s); 0 without per-rank buckets
    ranks_wait_s: float = 0.0

    @property
    def http_s(self) -> float:
        """send_s the engine and the other trainer ranks do not account for: HTTP, queueing on the engine thread,
        the sender's own work."""
        return max(0.0, self.send_s - self.engine_receive_s - self.engine_load_s - self.ranks_wait_s)

    def metrics(self) -> dict:
        return {"weight_sync_gather_convert_s": self.gather_convert_s, "weight_sync_control_s": self.control_s,
                "weight_sync_send_s": self.send_s, "weight_sync_flush_s": self.flush_s,
                "weight_sync_check_s": self.check_s, "weight_sync_engine_receive_s": self.engine_receive_s,
                "weight_sync_engine_load_s": self.engine_load_s,
                "weight_sync_engine_snapshot_s": self.engine_snapshot_s, "weight_sync_ranks_wait_s": self.ranks_wait_s}


@dataclass(frozen=True)
class SyncReport:
    seconds: float  # pause .. continue, verification included: how long generation was paused
    transfer_seconds: float  # pause .. flush: gather, convert, transfer, load
    gbps: float  # model bytes (one copy, however many engines) / transfer_seconds, 1e9 bytes per GB
    target_tensors: int
    mtp_tensors: int
    bytes: int
    buckets: int
    served_written: dict[str, int]  # empty when no coverage check ran
    split: SyncSplit = SyncSplit()
    checked: bool = True  # the checksum read-back ran (every --weight-sync-check-interval syncs)
    covered: bool = True  # the coverage check ran (with the checksums)
    draft_tensors: int = 0  # a trained separate draft's own tensors (selector `draft`)

    def metrics(self) -> dict:
        """The keys the training loop merges into each rollout's metrics line."""
        return {"weight_sync_s": self.seconds, "weight_sync_gbps": self.gbps, "rollout_paused_s": self.seconds,
                "weight_sync_params": self.target_tensors, "weight_sync_mtp_params": self.mtp_tensors,
                "weight_sync_draft_params": self.draft_tensors, "weight_sync_bytes": self.bytes,
                "weight_sync_buckets": self.buckets,
                "weight_sync_checked": int(self.checked), "weight_sync_covered": int(self.covered),
                **self.split.metrics()}


@contextlib.contextmanager
def one_intra_op_thread():
    """Run the sync's CPU tensor work (conversion, copies) on one intra-op thread. It is memory-bound, and
    OpenMP workers spin-waiting for a core the gloo sender or an engine holds cost far more than they gain:
    measured on 2 shared cores, converting a 177 MB model took 0.17 s on two threads and 0.003-0.009 s on one.
    CUDA work is unaffected; generation is paused meanwhile, so no other torch work needs the threads."""
    with intra_op_threads(1):
        yield


class Clock:
    """Accumulates wall time per phase of one sync (SyncSplit's fields without `_s`)."""

    def __init__(self):
        self.totals = {"gather_convert": 0.0, "control": 0.0, "send": 0.0, "flush": 0.0, "check": 0.0,
                       "engine_receive": 0.0, "engine_load": 0.0, "engine_snapshot": 0.0, "ranks_wait": 0.0}

    def add_engine(self, receive_s: float, load_s: float, snapshot_s: float = 0.0) -> None:
        """The engine's own seconds of one update (inside `send`; the snapshot inside the load)."""
        self.totals["engine_receive"] += receive_s
        self.totals["engine_load"] += load_s
        self.totals["engine_snapshot"] += snapshot_s

    def add(self, phase: str, seconds: float) -> None:
        """Seconds measured elsewhere (colocated.RankBuckets.wait_s: inside `send`)."""
        self.totals[phase] += seconds

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[phase] += time.perf_counter() - t0

    def timed_iter(self, phase: str, items: Iterable):
        """`items`, with the time spent producing each one counted to `phase`."""
        it = iter(items)
        while True:
            with self(phase):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item
