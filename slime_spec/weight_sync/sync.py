"""`WeightSyncer`: push the trainer's weights into every engine after a training step, verifiably.

One sync:
  pause generation (retract: running requests are recomputed with the new weights afterwards)
  -> [begin_weight_update {selector}]  (SGLang >= 0.5.23; not for disk, which needs no session)
  -> one update request per bucket (target, MTP and a trained draft's tensors each with their own selector;
     the next bucket is gathered and staged while this one is in flight); the last update also labels the
     weights and flushes the cache (SGLang >= 0.5.23: protocol.closes_with_last_update)
  -> [end_weight_update] -> [flush the cache, label the weights: where the last update did not]
  -> coverage: every weight the updated runners serve (target, and the MTP draft) was written; every sent
     tensor of a trained separate draft (--enable-draft-training) is served by the draft runner, and the
     draft's other tensors (neither sent nor shared with the target) are unchanged
  -> with check_weight_sync: served VALUES equal the sent tensors' (weight_sync/verify/readback.py: /get_weights_by_name
     slices where the model serves them; /weights_checker checksums only on engines with device cpu)
  -> continue generation.

Failure and engine state. A reply is not proof of what an engine serves (an engine restarted mid-sync
has no session and serves its checkpoint; a stray /end_weight_update keeps the buckets that landed), so
after a failure the syncer undoes first and reports after: it ends the sync on the other colocated trainer
ranks (per-rank buckets), closes the session on every engine that may hold it open (from the first
`/begin_weight_update` until every engine took `/end_weight_update`) with `/abort_weight_update` (a slime-spec
extension that restores every tensor the session wrote, where the engine has it; `/end_weight_update` on
SGLang, which cannot roll back), then reads every engine back (weight_sync/verify/served_state.py: its own
`/weights_checker`
checksums and weight_version; an engine whose read-back fails is `unverified`) and compares with the last
state it verified:
- generation continues only when every engine that answers was verified to serve the previous weights
  (`WeightSyncError.engines_serve_previous_weights`); an unreachable engine serves nothing and is named
  (the fleet restarts it and re-syncs it before it serves);
- otherwise generation stays paused, and the error names, per engine, what it serves (previous weights,
  the checkpoint, a mix, unreachable, unverified) with its weight_version and the checksum agreement
  count; the fix is to sync again (a full sync is idempotent) or restart the engines.
- a failed verification leaves the new weights loaded and generation paused.
With the distributed transport, an engine that rejects a request before joining the broadcast
leaves rank 0 waiting in the broadcast until the group's timeout (`timeout_s`). An engine lost mid-broadcast
fails it at once: rank 0 leaves the broken group, which ends the other engines' receives
(weight_sync/transports/http_transports.py); one
still stuck in it is named in `WeightSyncError.stuck_urls` and asked nothing more (the driver restarts it).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterable, Sequence

import torch

from slime_spec.config.run_config import WeightSyncConfig, resolve_transport
from slime_spec.fleet.client import EngineClient, EngineError, EngineGroupError, post_all
from slime_spec.weight_sync import protocol
from slime_spec.weight_sync.errors import WeightSyncError
from slime_spec.weight_sync.gather import NamedTensor, make_buckets, only_wanted
from slime_spec.weight_sync.report import Clock, SyncReport, SyncSplit, one_intra_op_thread
from slime_spec.weight_sync.transports.colocated import RankBuckets
from slime_spec.weight_sync.transports.http_transports import (
    BROKEN_GROUP_REPLY_S,
    BroadcastStuck,
    DiskTransport,
    DistributedTransport,
    TensorTransport,
    engine_seconds,
    engine_timing,
)
from slime_spec.weight_sync.verify import readback, served_state, sglang_params
from slime_spec.weight_sync.verify.after_sync import EngineChecks

__all__ = ["SyncReport", "WeightSyncError", "WeightSyncer"]

logger = logging.getLogger(__name__)


class WeightSyncer:
    def __init__(self, clients: Sequence[EngineClient], config: WeightSyncConfig, *, hf_config: dict,
                 hf_checkpoint: str | Path, spec: protocol.SpecSetup, has_mtp_layers: bool,
                 transport: str | None = None, colocate: bool = False, master_address: str = "127.0.0.1",
                 backend: str = "gloo", engine_tp_size: int = 1,
                 disk_dir: str | Path | None = None, timeout_s: float = 300.0, check_sample: int = 64,
                 trains_draft: bool = False, rank_buckets: RankBuckets | None = None):
        """trains_draft: the trainer also sends a separate draft's own tensors (`NamedTensor.kind == "draft"`,
        --enable-draft-training), loaded with selector `draft`. rank_buckets: colocated engines get one bucket per
        trainer rank (weight_sync/transports/colocated.py; the other ranks run colocated.follow_sync); None: rank 0's
        bucket for all."""
        if not clients:
            raise ValueError("WeightSyncer needs at least one engine")
        self.clients, self.config, self.hf_config = list(clients), config, hf_config
        self.hf_checkpoint, self.spec, self.has_mtp_layers = Path(hf_checkpoint), spec, has_mtp_layers
        self.trains_draft = trains_draft
        self.transport_name = resolve_transport(transport, colocate)
        if self.transport_name == "disk" and disk_dir is None:
            raise ValueError("transport disk needs disk_dir (a directory every engine can read)")
        if rank_buckets is not None and (self.transport_name != "tensor" or rank_buckets.layout.num_engines !=
                                         len(self.clients) or rank_buckets.layout.engine_tp_size != engine_tp_size):
            raise ValueError(f"per-rank buckets are for the tensor transport of --colocate, one engine per "
                             f"{rank_buckets.layout.engine_tp_size} trainer ranks: got transport "
                             f"{self.transport_name}, {len(self.clients)} engine(s) of --tp-size {engine_tp_size}")
        self.rank_buckets = rank_buckets
        self._transport_args = dict(master_address=master_address, backend=backend,
                                    engine_tp_size=engine_tp_size, disk_dir=disk_dir, timeout_s=timeout_s)
        self.protocol: protocol.Protocol | None = None
        self.plan: protocol.SelectorPlan | None = None
        self.transport = None
        self.engine_dtype: torch.dtype | None = None
        self.checks: EngineChecks | None = None  # built by prepare(): what the engines were verified to serve
        self.engine_device: str | None = None
        self.check_sample = check_sample
        self._syncs = 0  # completed syncs, for --weight-sync-check-interval
        # How a sync runs (both on; off is the earlier serial sync, for bench/weight_sync.py's side-by-side row):
        self.overlap_buckets = True  # gather and stage the next bucket while this one is in flight
        self.close_with_last_update = True  # label and flush with the last update (protocol.closes_with_last_update)

    # ---- set-up, once, from what the engines say about themselves ----
    def prepare(self) -> None:
        if self.plan is not None:
            return
        protocols = {c.url: protocol.detect_engine_protocol(c) for c in self.clients}
        sessions = {p.session for p in protocols.values()}
        if len(sessions) != 1:
            raise ValueError(f"engines speak different weight-update protocols: {protocols}; run one SGLang version")
        self.protocol = next(iter(protocols.values()))
        self.plan = protocol.plan_selectors(self.spec, self.has_mtp_layers, self.transport_name,
                                            self.protocol.session, self.trains_draft)
        self.engine_dtype = self._engine_dtype()
        self.engine_device = self.clients[0].server_info().get("device")
        a = self._transport_args
        if self.transport_name == "distributed":
            self.transport = DistributedTransport(self.clients, a["master_address"],
                                                  backend=a["backend"], engine_tp_size=a["engine_tp_size"],
                                                  session=self.protocol.session, timeout_s=a["timeout_s"])
        elif self.transport_name == "tensor":
            self.transport = TensorTransport(self.clients, engine_tp_size=a["engine_tp_size"],
                                             session=self.protocol.session, rank_buckets=self.rank_buckets)
        else:
            self.transport = DiskTransport(self.clients, a["disk_dir"], self.hf_checkpoint,
                                           session=self.protocol.session)
        self.checks = EngineChecks(self.clients, session=self.protocol.session, plan=self.plan, spec=self.spec,
                                   hf_config=self.hf_config, engine_dtype=self.engine_dtype,
                                   engine_device=self.engine_device, check_sample=self.check_sample)

    @property
    def engine_device(self) -> str | None:
        """The engines' device, as /server_info says (it decides how served values are checked)."""
        return self._engine_device

    @engine_device.setter
    def engine_device(self, device: str | None) -> None:
        self._engine_device = device
        if self.checks is not None:
            self.checks.engine_device = device

    @property
    def last_value_checks(self) -> list[readback.ValueCheck]:
        """The value checks of the latest sync with check_weight_sync."""
        return self.checks.last_value_checks if self.checks is not None else []

    def _engine_dtype(self) -> torch.dtype | None:
        """The dtype the engines serve (and SGLang's checksums hash): /server_info's `dtype`, with 'auto' resolved by
        SGLang's own rule (the checkpoint's dtype; float32 checkpoints served in float16)."""
        return sglang_params.served_dtype(self.hf_config, self.clients[0].server_info().get("dtype") or "auto")

    # ---- one sync ----
    def sync(self, tensors: Iterable[NamedTensor], weight_version: str | None = None) -> dict:
        """Push `tensors` (HF names, full) into every engine; returns the metrics dict for this sync."""
        return self.sync_report(tensors, weight_version).metrics()

    def sync_report(self, tensors: Iterable[NamedTensor], weight_version: str | None = None) -> SyncReport:
        if self.rank_buckets is not None:
            self.rank_buckets.next_sync()
        try:
            with one_intra_op_thread():
                return self._sync_report(tensors, weight_version)
        except BaseException as e:  # a failure outside the transfer (prepare, an interrupt): _failed did not run
            if self.rank_buckets is not None:
                self.rank_buckets.abort(repr(e))  # a no-op where _failed or finish already ended the sync
            raise

    def _sync_report(self, tensors: Iterable[NamedTensor], weight_version: str | None) -> SyncReport:
        self.prepare()
        plan, session = self.plan, self.protocol.session
        use_session = session and self.transport_name != "disk"
        recorded = self.checks.recorder() if self.config.check_weight_sync else None
        counts, nbytes, buckets, buckets_applied = {"target": 0, "mtp": 0, "draft": 0}, 0, 0, 0
        sent, draft_sent = set(), set()  # a trained draft's names apart: they may be the target's
        in_flight = None  # the bucket posted last (an InFlight), its replies not read yet
        clock = Clock()
        t0 = time.perf_counter()
        session_open = False
        try:
            with clock("control"):
                post_all(self.clients, "/pause_generation", protocol.pause_payload("retract"))
            if self.checks.needs_baseline:
                with clock("check"):
                    self.checks.read_baseline()
            with clock("control"):
                self.transport.start()
                if self.rank_buckets is not None:
                    self.rank_buckets.start(plan.mtp is not None, plan.draft is not None,
                                            self.config.update_weight_buffer_size,
                                            flatten=self.transport.load_format is not None)
                if use_session:  # open on the engines that took begin, even if another refused it
                    session_open = True
                    post_all(self.clients, "/begin_weight_update",
                             protocol.begin_payload(protocol.session_selector(plan)))
            stream = clock.timed_iter("gather_convert", make_buckets(only_wanted(tensors, plan),
                                                                     self.config.update_weight_buffer_size))
            closes = self.close_with_last_update and protocol.closes_with_last_update(session, self.transport_name)
            closed = False  # the last update labelled the weights and flushed the cache
            for bucket in stream:  # gathered and staged while the previous bucket is in flight
                with clock("send"):
                    staged = self.transport.stage(bucket)
                landing, in_flight = in_flight, None  # not settled again in `except` if its wait raises
                buckets_applied += self._land(landing, clock)
                selector = {"target": plan.target, "mtp": plan.mtp, "draft": plan.draft}[bucket.kind]
                closed = closes and bucket.last  # a version only on the last: it labels weights that have all landed
                with clock("send"):
                    in_flight = self.transport.post(staged, selector, weight_version if closed else None,
                                                    flush_cache=closed)
                del staged  # the transport holds it while it is in flight
                buckets += 1
                counts[bucket.kind] += len(bucket.tensors)
                nbytes += bucket.nbytes
                (draft_sent if bucket.kind == "draft" else sent).update(bucket.names)
                if recorded is not None:
                    recorded.add(bucket)
                if not self.overlap_buckets:
                    landing, in_flight = in_flight, None
                    buckets_applied += self._land(landing, clock)
            landing, in_flight = in_flight, None
            buckets_applied += self._land(landing, clock)
            with clock("send"):
                self.transport.finish(weight_version)
            if self.rank_buckets is not None:
                clock.add("ranks_wait", self.rank_buckets.wait_s)
            with clock("control"):
                if use_session:  # open until every engine has ended it: _failed rolls back where end failed
                    post_all(self.clients, "/end_weight_update", protocol.end_payload())
                    session_open = False
            if not closed:
                with clock("flush"):
                    post_all(self.clients, "/flush_cache", {})
            if weight_version is not None and self.transport_name != "disk" and not closed:  # disk's update has it
                with clock("control"):
                    post_all(self.clients, "/update_weight_version", protocol.weight_version_payload(weight_version))
        except Exception as e:
            notes = []
            if in_flight is not None:  # the bucket on the wire lands (or fails) before anything is undone
                unsettled = in_flight.settle(min(self._transport_args["timeout_s"], BROKEN_GROUP_REPLY_S))
                buckets_applied += unsettled is None and self.transport_name != "disk"
                if unsettled is not None:
                    notes.append(f"the bucket on the wire when this failed did not land: {unsettled}")
            raise self._failed(e, buckets_applied, session_open, weight_version, notes) from e
        transfer_s = time.perf_counter() - t0
        self._syncs += 1
        checked = recorded is not None or self._syncs % max(1, self.config.weight_sync_check_interval) == 0
        with clock("check"):
            served_written = self.checks.after_sync(sent, recorded, draft_sent, checked)
        with clock("control"):
            post_all(self.clients, "/continue_generation", protocol.continue_payload())
        seconds = time.perf_counter() - t0
        split = SyncSplit(**{f"{k}_s": v for k, v in clock.totals.items()})
        return SyncReport(seconds=seconds, transfer_seconds=transfer_s, gbps=nbytes / transfer_s / 1e9,
                          target_tensors=counts["target"], mtp_tensors=counts["mtp"], bytes=nbytes,
                          buckets=buckets, served_written=served_written, split=split, checked=checked,
                          covered=bool(served_written), draft_tensors=counts["draft"])

    def _land(self, in_flight, clock: Clock) -> int:
        """Wait for a posted bucket's replies (EngineGroupError if an engine failed it) and count the engines' time;
        the number of buckets now applied on the engines (disk buckets load only in finish())."""
        if in_flight is None:
            return 0
        with clock("send"):
            replies = in_flight.wait()
        clock.add_engine(*engine_seconds(replies), snapshot_s=engine_timing(replies, "snapshot_s"))
        return int(self.transport_name != "disk")

    def _failed(self, error: Exception, buckets_applied: int, session_open: bool,
                weight_version: str | None, notes: list[str] | None = None) -> WeightSyncError:
        """Undo first, then report what was verified: end the sync on the other trainer ranks (they wait in the
        bucket exchange), close the session on every engine (rolled back where the engine can), read every engine
        back, and continue generation only if each engine that answers was verified, by its own checksums, to
        serve the previous weights. No step's failure skips the ones after it; each is named in the error."""
        notes = list(notes or [])
        stuck = error.urls if isinstance(error, BroadcastStuck) else []  # their routes would wait on the collective
        self._end_other_ranks(error, notes)
        if session_open:
            rolled_back = self._close_session(notes, skip=stuck)
            notes.insert(0, f"{len(rolled_back)} of {len(self.clients)} engine(s) rolled the session back "
                            f"(/abort_weight_update){': ' + ', '.join(rolled_back) if rolled_back else ''}")
        verdicts = self.checks.judge_engines(stuck)
        serving = [v for v in verdicts if v.serves != "unreachable"]
        previous = bool(serving) and all(v.serves == "previous" for v in serving)
        state = self._resume_on_previous(serving, len(verdicts)) if previous else (
            "generation stays PAUSED on every engine: not every engine was verified to serve the previous "
            "weights; sync again (a full sync is idempotent) or restart the engines")
        message = (f"weight sync (version {weight_version}, transport {self.transport_name}) failed after "
                   f"{buckets_applied} applied bucket(s): {error}. Per engine: "
                   + "; ".join(v.describe() for v in verdicts) + f". {state}."
                   + (f" Undo: {'; '.join(notes)}." if notes else ""))
        return WeightSyncError(message, engines_serve_previous_weights=previous, engines=verdicts, stuck_urls=stuck)

    def _end_other_ranks(self, error: Exception, notes: list[str]) -> None:
        """The other colocated trainer ranks wait in the bucket exchange for this sync's next message: end it
        there first, so they do not wait through the rollback and read-back (a no-op once the sync has ended)."""
        if self.rank_buckets is None:
            return
        try:
            self.rank_buckets.abort(repr(error))
        except Exception as e:  # the engines are rolled back and read back all the same
            notes.append(f"ending the sync on the other trainer ranks failed: {e!r}")

    def _resume_on_previous(self, serving: list[served_state.EngineVerdict], engines: int) -> str:
        """Continue generation on the engines verified on the previous weights; says what happened."""
        try:
            post_all([c for c in self.clients if c.url in {v.url for v in serving}], "/continue_generation",
                     protocol.continue_payload())
            state = "generation continues on every engine that answers, all verified on the previous weights"
        except Exception as cont_error:
            state = ("every engine that answers serves the previous weights, but continuing generation "
                     f"failed: {cont_error}")
        if len(serving) < engines:
            state += ("; an unreachable engine serves nothing, and a restarted one must get the current weights "
                      "before it serves (the fleet's re-sync)")
        return state

    def _close_session(self, notes: list[str], skip: Sequence[str] = ()) -> list[str]:
        """Per engine: roll the open session back (`/abort_weight_update`); where the engine has no rollback
        (404: SGLang) or had no session left to roll back, close it with `/end_weight_update`. What the
        engines serve afterwards is read back by `EngineChecks.judge_engines`, never assumed from these replies.
        Returns the URLs of the engines that say they rolled back."""
        rolled_back = []
        for client in self.clients:
            if client.url in skip:
                continue
            try:
                reply = client.post("/abort_weight_update", {})
                if isinstance(reply, dict) and reply.get("rolled_back") is True:
                    rolled_back.append(client.url)
                else:
                    notes.append(f"{client.url} had no open session to roll back "
                                 f"({reply.get('message') if isinstance(reply, dict) else reply!r})")
                continue
            except EngineError as e:
                if e.unreachable:
                    continue  # reported by judge_engines
                if e.status != 404:
                    notes.append(f"rolling the session back on {client.url} failed: {e}")
            try:
                client.post("/end_weight_update", protocol.end_payload())
            except EngineError as e:
                if not e.unreachable:
                    notes.append(f"closing the weight-update session on {client.url} failed: {e}")
        return rolled_back

    # ---- a restarted engine ----
    def rejoin(self, restarted_urls: Sequence[str]) -> None:
        """Engines at `restarted_urls` were restarted: they serve the checkpoint and, with the distributed
        transport, left the weight-update group. Drop the cached group (the survivors leave it too) so
        the next sync, a full one like every sync, forms a new group of every engine (on a fresh port, as every
        group is).
        Without this the next broadcast waits for ranks that are gone until the group's timeout."""
        if self.transport_name != "distributed" or self.transport is None:
            return
        try:
            self.transport.close()
        except EngineGroupError as e:  # a restarted engine has no group to leave; any other failure is real
            unexpected = {url: err for url, err in e.failures.items() if url not in set(restarted_urls)}
            if unexpected:
                raise

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
