"""`WeightSyncer`: push the trainer's weights into every engine after a training step, verifiably.

One sync:
  pause generation (retract: running requests are recomputed with the new weights afterwards)
  -> [begin_weight_update {selector}]  (SGLang >= 0.5.23; not for disk, which needs no session)
  -> one update request per bucket (target, MTP and a trained draft's tensors each with their own selector)
  -> [end_weight_update] -> flush the cache
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
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from slime_spec.common.net import free_port
from slime_spec.config.run_config import WeightSyncConfig, resolve_transport
from slime_spec.fleet.client import EngineClient, EngineError, EngineGroupError, post_all
from slime_spec.weight_sync import protocol
from slime_spec.weight_sync.gather import NamedTensor, make_buckets, only_wanted
from slime_spec.weight_sync.report import Clock, SyncReport, SyncSplit, one_intra_op_thread
from slime_spec.weight_sync.transports.colocated import RankBuckets
from slime_spec.weight_sync.transports.http_transports import (
    BroadcastStuck,
    DiskTransport,
    DistributedTransport,
    TensorTransport,
    engine_seconds,
    engine_timing,
)
from slime_spec.weight_sync.verify import coverage as verify
from slime_spec.weight_sync.verify import readback, served_state, sglang_params

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A sync failed; `engines_serve_previous_weights` says whether generation was resumed on old weights
    (every engine that answers was verified to serve them); `engines` says what each engine was verified to serve;
    `stuck_urls`: engines left stuck in a broken broadcast, which serve nothing until restarted."""

    def __init__(self, message: str, engines_serve_previous_weights: bool,
                 engines: Sequence[served_state.EngineVerdict] = (), stuck_urls: Sequence[str] = ()):
        super().__init__(message)
        self.engines_serve_previous_weights = engines_serve_previous_weights
        self.engines = list(engines)
        self.stuck_urls = list(stuck_urls)

    def metrics(self) -> dict:
        out = {"weight_sync_failed": 1, "weight_sync_resumed_on_previous": int(self.engines_serve_previous_weights)}
        for i, verdict in enumerate(self.engines):
            out.update(verdict.metrics(i))
        return out


@dataclass
class Recorded:
    """What check_weight_sync keeps of the sent tensors while they stream past (never the whole model)."""

    sample: readback.ValueSample  # leading rows of a sample of target tensors
    checksums: sglang_params.ServedChecksums | None  # what SGLang hashes on CPU, for engines on device cpu
    draft_checksums: sglang_params.ServedChecksums | None = None  # a trained draft's, apart: its names may be
    # the target's (`lm_head.weight`)

    def add(self, bucket) -> None:
        for t in bucket.tensors:
            if bucket.kind == "target":
                self.sample.add(t.name, t.tensor)
            recorder = self.draft_checksums if bucket.kind == "draft" else self.checksums
            if recorder is not None:
                recorder.add(t.name, t.tensor)


class WeightSyncer:
    def __init__(self, clients: Sequence[EngineClient], config: WeightSyncConfig, *, hf_config: dict,
                 hf_checkpoint: str | Path, spec: protocol.SpecSetup, has_mtp_layers: bool,
                 transport: str | None = None, colocate: bool = False, master_address: str = "127.0.0.1",
                 master_port: int | None = None, backend: str = "gloo", engine_tp_size: int = 1,
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
        if self.transport_name == "distributed" and master_port is None:
            raise ValueError("transport distributed needs master_port (a free port on the trainer's rank 0)")
        if self.transport_name == "disk" and disk_dir is None:
            raise ValueError("transport disk needs disk_dir (a directory every engine can read)")
        if rank_buckets is not None and (self.transport_name != "tensor" or rank_buckets.layout.num_engines !=
                                         len(self.clients) or rank_buckets.layout.engine_tp_size != engine_tp_size):
            raise ValueError(f"per-rank buckets are for the tensor transport of --colocate, one engine per "
                             f"{rank_buckets.layout.engine_tp_size} trainer ranks: got transport "
                             f"{self.transport_name}, {len(self.clients)} engine(s) of --tp-size {engine_tp_size}")
        self.rank_buckets = rank_buckets
        self._transport_args = dict(master_address=master_address, master_port=master_port, backend=backend,
                                    engine_tp_size=engine_tp_size, disk_dir=disk_dir, timeout_s=timeout_s)
        self.protocol: protocol.Protocol | None = None
        self.plan: protocol.SelectorPlan | None = None
        self.transport = None
        self.engine_dtype: torch.dtype | None = None
        self.engine_device: str | None = None
        self.check_sample = check_sample
        self.last_value_checks: list[readback.ValueCheck] = []  # of the latest sync with check_weight_sync
        self._external_draft_checksums: dict[str, str] | None = None
        # per engine URL: what it served when prepared (the checkpoint, for a fresh engine) and after the last
        # verified sync; None where unknown (no /weights_checker, or a sync whose check was skipped or failed)
        self._checkpoint: dict[str, served_state.ServedState | None] | None = None  # read by the first sync
        self._verified: dict[str, served_state.ServedState | None] = {}
        self._syncs = 0  # completed syncs, for --weight-sync-check-interval

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
            self.transport = DistributedTransport(self.clients, a["master_address"], a["master_port"],
                                                  backend=a["backend"], engine_tp_size=a["engine_tp_size"],
                                                  session=self.protocol.session, timeout_s=a["timeout_s"])
        elif self.transport_name == "tensor":
            self.transport = TensorTransport(self.clients, engine_tp_size=a["engine_tp_size"],
                                             session=self.protocol.session, rank_buckets=self.rank_buckets)
        else:
            self.transport = DiskTransport(self.clients, a["disk_dir"], self.hf_checkpoint,
                                           session=self.protocol.session)
        if self.spec.uses_draft and not self.spec.native_mtp and self.protocol.session:
            self._external_draft_checksums = self._draft_checksums()

    def _recorder(self) -> "Recorded":
        """What the value check needs of the sent tensors: a sample of leading rows, and (CPU engines only,
        the one place SGLang's checksum is reproducible here) the checksum SGLang computes of every served tensor."""
        on_cpu = self.engine_device == "cpu"
        roles = sglang_params.sync_roles(self.hf_config, self.engine_dtype, mtp_draft=self.plan.mtp is not None)
        draft_role = sglang_params.separate_draft_role(self.spec.algorithm, self.engine_dtype)
        checksums = sglang_params.ServedChecksums(roles) if on_cpu and roles else None
        draft = sglang_params.ServedChecksums(draft_role) if on_cpu and self.plan.draft and draft_role else None
        return Recorded(readback.ValueSample(self.engine_dtype, self.check_sample), checksums, draft)

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
        recorded = self._recorder() if self.config.check_weight_sync else None
        counts, nbytes, buckets, buckets_applied = {"target": 0, "mtp": 0, "draft": 0}, 0, 0, 0
        sent, draft_sent = set(), set()  # a trained draft's names apart: they may be the target's
        clock = Clock()
        t0 = time.perf_counter()
        session_open = False
        try:
            with clock("control"):
                post_all(self.clients, "/pause_generation", protocol.pause_payload("retract"))
            if self._checkpoint is None:
                with clock("check"):
                    self._read_baseline()
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
            for bucket in stream:
                selector = {"target": plan.target, "mtp": plan.mtp, "draft": plan.draft}[bucket.kind]
                with clock("send"):
                    replies = self.transport.send(bucket, selector, None)  # labelled once it has all landed
                clock.add_engine(*engine_seconds(replies), snapshot_s=engine_timing(replies, "snapshot_s"))
                buckets += 1
                buckets_applied += self.transport_name != "disk"  # disk buckets only load in finish()
                counts[bucket.kind] += len(bucket.tensors)
                nbytes += bucket.nbytes
                (draft_sent if bucket.kind == "draft" else sent).update(bucket.names)
                if recorded is not None:
                    recorded.add(bucket)
            with clock("send"):
                self.transport.finish(weight_version)
            if self.rank_buckets is not None:
                clock.add("ranks_wait", self.rank_buckets.wait_s)
            with clock("control"):
                if use_session:  # open until every engine has ended it: _failed rolls back where end failed
                    post_all(self.clients, "/end_weight_update", protocol.end_payload())
                    session_open = False
            with clock("flush"):
                post_all(self.clients, "/flush_cache", {})
            if weight_version is not None and self.transport_name != "disk":  # disk's one update carried it
                with clock("control"):
                    post_all(self.clients, "/update_weight_version", protocol.weight_version_payload(weight_version))
        except Exception as e:
            raise self._failed(e, buckets_applied, session_open, weight_version) from e
        transfer_s = time.perf_counter() - t0
        self._syncs += 1
        checked = recorded is not None or self._syncs % max(1, self.config.weight_sync_check_interval) == 0
        with clock("check"):
            if checked:
                served_written = self._verify(sent, recorded, draft_sent)
            elif self._external_draft_checksums is not None:
                served_written = self._verify_between(sent, draft_sent)
            else:
                served_written = self._skip_check()
        with clock("control"):
            post_all(self.clients, "/continue_generation", protocol.continue_payload())
        seconds = time.perf_counter() - t0
        split = SyncSplit(**{f"{k}_s": v for k, v in clock.totals.items()})
        return SyncReport(seconds=seconds, transfer_seconds=transfer_s, gbps=nbytes / transfer_s / 1e9,
                          target_tensors=counts["target"], mtp_tensors=counts["mtp"], bytes=nbytes,
                          buckets=buckets, served_written=served_written, split=split, checked=checked,
                          covered=bool(served_written), draft_tensors=counts["draft"])

    def _verify_between(self, sent: set[str], draft_sent: set[str]) -> dict[str, int]:
        """The check between checksum read-backs: an external draft's own weights by the checksums of the draft
        runner alone (slime#1177; SGLang has no cheaper listing of what a runner serves). The target is not
        checksummed, so what the engines serve counts as unverified, as after a skipped check."""
        problems = []
        for client in self.clients:
            reply = post_all([client], "/weights_checker", protocol.checksum_payload("draft", True))[0]
            self._frozen_draft_problems(client, verify.served_by_role(reply), problems, draft_sent)
        if problems:
            self._skip_check()
            raise WeightSyncError("weight sync verification failed: " + "; ".join(problems)
                                  + ". Generation stays paused.", engines_serve_previous_weights=False)
        return self._skip_check()

    def _skip_check(self) -> dict[str, int]:
        """No coverage check this sync: what the engines serve now is not verified, so a failure of the next
        sync cannot claim they serve the previous weights (served_state.judge says "unverified")."""
        self._verified = {c.url: None for c in self.clients}
        return {}

    def _failed(self, error: Exception, buckets_applied: int, session_open: bool,
                weight_version: str | None) -> WeightSyncError:
        """Undo first, then report what was verified: end the sync on the other trainer ranks (they wait in the
        bucket exchange), close the session on every engine (rolled back where the engine can), read every engine
        back, and continue generation only if each engine that answers was verified, by its own checksums, to
        serve the previous weights. No step's failure skips the ones after it; each is named in the error."""
        notes: list[str] = []
        stuck = error.urls if isinstance(error, BroadcastStuck) else []  # their routes would wait on the collective
        self._end_other_ranks(error, notes)
        if session_open:
            rolled_back = self._close_session(notes, skip=stuck)
            notes.insert(0, f"{len(rolled_back)} of {len(self.clients)} engine(s) rolled the session back "
                            f"(/abort_weight_update){': ' + ', '.join(rolled_back) if rolled_back else ''}")
        verdicts = self._judge_engines(stuck)
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

    def _read_baseline(self) -> None:
        """What every engine serves before this syncer's first update (the checkpoint, for a fresh engine)."""
        self._checkpoint = {c.url: served_state.read_served(c, self.protocol.session) for c in self.clients}
        self._verified = dict(self._checkpoint)

    def _close_session(self, notes: list[str], skip: Sequence[str] = ()) -> list[str]:
        """Per engine: roll the open session back (`/abort_weight_update`); where the engine has no rollback
        (404: SGLang) or had no session left to roll back, close it with `/end_weight_update`. What the
        engines serve afterwards is read back by `_judge_engines`, never assumed from these replies.
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
                    continue  # reported by _judge_engines
                if e.status != 404:
                    notes.append(f"rolling the session back on {client.url} failed: {e}")
            try:
                client.post("/end_weight_update", protocol.end_payload())
            except EngineError as e:
                if not e.unreachable:
                    notes.append(f"closing the weight-update session on {client.url} failed: {e}")
        return rolled_back

    def _judge_engines(self, stuck: Sequence[str] = ()) -> list[served_state.EngineVerdict]:
        """What every engine serves, read back. An engine whose read-back fails is `unverified`, naming why:
        the report claims nothing it did not read, and the sync's own error is not replaced by this one. An engine
        `stuck` in a broken broadcast is not asked (its scheduler is blocked): it serves nothing until restarted."""
        verdicts = []
        for client in self.clients:
            if client.url in stuck:
                verdicts.append(served_state.EngineVerdict(client.url, "unreachable", reason=(
                    "stuck in the broken broadcast; it serves nothing until it is restarted")))
                continue
            try:
                now = served_state.read_served(client, self.protocol.session)
            except EngineError as e:
                verdicts.append(served_state.unreachable(client.url, e) if e.unreachable
                                else served_state.unread(client.url, e))
                continue
            except Exception as e:  # a malformed /weights_checker reply (no checksums)
                verdicts.append(served_state.unread(client.url, e))
                continue
            verdicts.append(served_state.judge(client.url, now, self._verified.get(client.url),
                                               (self._checkpoint or {}).get(client.url)))
        return verdicts

    # ---- verification ----
    def _verify(self, sent: set[str], recorded: "Recorded | None", draft_sent: set[str]) -> dict[str, int]:
        """Check every engine; raise WeightSyncError listing each problem (generation stays paused)."""
        roles = {"target", "draft"} if self.plan.mtp is not None else {"target"}
        problems, written, states = [], {}, {}
        self.last_value_checks = []
        for client in self.clients:
            try:
                reply = post_all([client], "/weights_checker",
                                 protocol.checksum_payload("all", self.protocol.session))[0]
            except EngineGroupError as e:
                if not all(getattr(err, "status", None) == 404 for err in e.failures.values()):
                    raise
                reply = None
            if reply is None:
                written = self._verify_by_name(client, sent, problems)
                states[client.url] = None
            else:
                written = self._verify_coverage(client, reply, sent, roles, problems, draft_sent)
                states[client.url] = served_state.ServedState(served_state.weight_version_of(client),
                                                              served_state.checksums_of(reply))
            if recorded is not None:
                check = self._check_values(client, reply, recorded, sent, roles, draft_sent)
                self.last_value_checks.append(check)
                problems += [f"{client.url}: check_weight_sync ({'+'.join(check.methods) or 'no method'}): {p}"
                             for p in check.problems[:8]]
        if problems:
            self._verified = {c.url: None for c in self.clients}  # what they serve now was not verified
            raise WeightSyncError("weight sync verification failed: " + "; ".join(problems)
                                  + ". Generation stays paused.", engines_serve_previous_weights=False)
        self._verified = states
        return written

    def _verify_coverage(self, client: EngineClient, reply: dict, sent: set[str], roles: set[str],
                         problems: list[str], draft_sent: set[str]) -> dict:
        written = self._coverage_problems(client, reply, sent, roles, problems, draft_sent)
        if self._external_draft_checksums is not None:
            self._frozen_draft_problems(client, verify.served_by_role(reply), problems, draft_sent)
        return written

    def _coverage_problems(self, client: EngineClient, reply: dict, sent: set[str], roles: set[str],
                           problems: list[str], draft_sent: set[str]) -> dict:
        served = verify.served_by_role(reply)
        coverage = verify.check_coverage(served, sent, roles)
        for role, missing in coverage.missing.items():
            if missing:
                problems.append(f"{client.url}: {len(missing)} weight(s) the {role} runner serves were not "
                                f"written: {missing[:8]}")
        if self.plan.draft:
            taken = verify.draft_tensors_written(served, draft_sent)
            for role, names in (taken or {"draft": set()}).items():
                unserved = sorted(draft_sent - names)
                if unserved:
                    problems.append(f"{client.url}: {len(unserved)} sent draft tensor(s) are not served by its "
                                    f"{role} runner: {unserved[:8]} (check the draft checkpoint's names)")
                coverage.written[role] = len(names)
        return coverage.written

    def _frozen_draft_problems(self, client: EngineClient, served: dict, problems: list[str],
                               draft_sent: set[str]) -> None:
        now, before = _draft_only(served), self._external_draft_checksums
        if self.plan.draft:  # trained: only what the sync does not write must stay as loaded
            before = {n: c for n, c in before.items() if not verify.written_by_draft_sync(n, draft_sent)}
        changed = sorted(n for n in before if now.get(n) != before[n])
        if changed:
            problems.append(f"{client.url}: the external draft ({self.spec.algorithm}) must keep its own "
                            f"weights, but {len(changed)} of its tensors changed: {changed[:8]} (slime#1177)")

    def _check_values(self, client: EngineClient, reply: dict | None, recorded: "Recorded", sent: set[str],
                      roles: set[str], draft_sent: set[str]) -> readback.ValueCheck:
        """Served values against the sent tensors (weight_sync/verify/readback.py says which method applies when)."""
        checksum_problems, checksum_count = None, 0
        if reply is not None and recorded.checksums is not None:
            checksum_problems = []
            if verify.engine_tp_size(reply) > 1:
                checksum_problems.append("whole-tensor checksums need engine TP 1 (a TP > 1 engine hashes shards)")
            served = verify.served_by_role(reply)
            expected = [(served, recorded.checksums, roles)]
            if recorded.draft_checksums is not None:
                drafts = {r: names for r, names in served.items() if r != "target"}
                expected.append((drafts, recorded.draft_checksums, {"draft"}))
            for runners, checksums, wanted in expected:
                checksum_problems += [f"{name}: only some of its stacked parts were sent"
                                      for name in checksums.incomplete()]
                checksum_problems += verify.compare_checksums(runners, checksums.checksums, wanted)
                checksum_count += sum(len(names) for names in checksums.checksums.values())
        target_sent = sorted(n for n in sent if not self._is_mtp_name(n))
        probe = "model.embed_tokens.weight" if "model.embed_tokens.weight" in sent else target_sent[0]
        return readback.check_values(client, recorded.sample, device=self.engine_device, probe=probe,
                                     checksum_problems=checksum_problems, checksum_count=checksum_count)

    def _verify_by_name(self, client: EngineClient, sent: set[str], problems: list[str]) -> dict:
        """For an SGLang without /weights_checker: ask for each sent target weight by name.

        This proves every sent target tensor is served; it cannot list what the engine serves beyond
        that, nor read the draft runner (SGLang's get_weights_by_name reads the target).
        """
        logger.warning("%s has no /weights_checker: verifying the target by /get_weights_by_name; the draft "
                       "runner cannot be verified on this SGLang", client.url)
        names = sorted(n for n in sent if not self._is_mtp_name(n))
        unserved = []
        for name in names:
            reply = client.post("/get_weights_by_name", protocol.get_weights_payload(name, 1))
            values = reply.get("result") if isinstance(reply, dict) else reply
            if not values:
                unserved.append(name)
        if unserved:
            problems.append(f"{client.url}: {len(unserved)} sent target weight(s) are not served: {unserved[:8]}")
        return {"target": len(names) - len(unserved)}

    def _is_mtp_name(self, name: str) -> bool:
        from slime_spec.weight_sync.gather import hf_mtp_matcher
        return hf_mtp_matcher(self.hf_config)(name)

    def _draft_checksums(self) -> dict[str, str]:
        """The external draft's own tensors, before any sync (those it shares with the target are left out)."""
        reply = post_all(self.clients[:1], "/weights_checker", protocol.checksum_payload("all", True))[0]
        return verify.frozen_draft_checksums(verify.served_by_role(reply))

    # ---- a restarted engine ----
    def rejoin(self, restarted_urls: Sequence[str]) -> None:
        """Engines at `restarted_urls` were restarted: they serve the checkpoint and, with the distributed
        transport, left the weight-update group. Drop the cached group (the survivors leave it too) so
        the next sync, a full one like every sync, forms a new group of every engine on a fresh port.
        Without this the next broadcast waits for ranks that are gone until the group's timeout."""
        if self.transport_name != "distributed" or self.transport is None:
            return
        try:
            self.transport.close()
        except EngineGroupError as e:  # a restarted engine has no group to leave; any other failure is real
            unexpected = {url: err for url, err in e.failures.items() if url not in set(restarted_urls)}
            if unexpected:
                raise
        a = self._transport_args
        a["master_port"] = free_port("")
        self.transport = DistributedTransport(self.clients, a["master_address"], a["master_port"],
                                              backend=a["backend"], engine_tp_size=a["engine_tp_size"],
                                              session=self.protocol.session, timeout_s=a["timeout_s"])

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _draft_only(served: dict[str, dict[str, str]]) -> dict[str, str]:
    return {f"{role}.{name}": c for role, names in served.items() if role != "target" for name, c in names.items()}
