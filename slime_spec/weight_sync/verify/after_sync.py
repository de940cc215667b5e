"""What the syncer checks of the engines around a sync, and the state it checks against.

Before the first update: what every engine serves (`read_baseline`: the checkpoint, for a fresh engine). After a
sync (`after_sync`): coverage, every weight the updated runners serve was written, and with check_weight_sync the
served values against the sent tensors (readback.py), every --weight-sync-check-interval syncs; in between only an
external draft's own checksums (slime#1177). After a failed sync (`judge_engines`): what every engine serves now,
read back and compared with the last verified state (served_state.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from slime_spec.fleet.client import EngineClient, EngineError, EngineGroupError, post_all
from slime_spec.weight_sync import fp8, protocol
from slime_spec.weight_sync.errors import WeightSyncError
from slime_spec.weight_sync.verify import coverage as verify
from slime_spec.weight_sync.verify import readback, served_state, sglang_params

logger = logging.getLogger(__name__)


@dataclass
class Recorded:
    """What check_weight_sync keeps of the sent tensors while they stream past (never the whole model)."""

    sample: readback.ValueSample  # leading rows of a sample of target tensors
    checksums: sglang_params.ServedChecksums | None  # what SGLang hashes on CPU, for engines on device cpu
    draft_checksums: sglang_params.ServedChecksums | None = None  # a trained draft's, apart: its names may be
    # the target's (`lm_head.weight`)

    def add(self, bucket) -> None:
        for t in bucket.tensors:
            # An FP8 weight is value-checked by checksum only (CPU engines): SGLang answers /get_weights_by_name
            # with its raw FP8 codes, an engine holding dequantized weights with their values.
            if bucket.kind == "target" and t.tensor.dtype != fp8.FP8_DTYPE and not fp8.is_scale(t.name):
                self.sample.add(t.name, t.tensor)
            recorder = self.draft_checksums if bucket.kind == "draft" else self.checksums
            if recorder is not None:
                recorder.add(t.name, t.tensor)


class EngineChecks:
    """The checks of one syncer's engines and what they were last verified to serve (per engine URL: the
    checkpoint, read before the first update, and the state after the last verified sync; None where unknown)."""

    def __init__(self, clients: Sequence[EngineClient], *, session: bool, plan: protocol.SelectorPlan,
                 spec: protocol.SpecSetup, hf_config: dict, engine_dtype: torch.dtype | None,
                 engine_device: str | None, check_sample: int):
        self.clients, self.session, self.plan, self.spec = list(clients), session, plan, spec
        self.hf_config, self.engine_dtype, self.engine_device = hf_config, engine_dtype, engine_device
        self.check_sample = check_sample
        self.last_value_checks: list[readback.ValueCheck] = []  # of the latest sync with check_weight_sync
        self._checkpoint: dict[str, served_state.ServedState | None] | None = None  # read by the first sync
        self._verified: dict[str, served_state.ServedState | None] = {}
        self._external_draft_checksums: dict[str, str] | None = None
        if spec.uses_draft and not spec.native_mtp and session:
            self._external_draft_checksums = self._draft_checksums()

    @property
    def needs_baseline(self) -> bool:
        return self._checkpoint is None

    def after_sync(self, sent: set[str], recorded: "Recorded | None", draft_sent: set[str],
                   checked: bool) -> dict[str, int]:
        """The checks after a sync whose updates all landed; the written count per runner ({} when not covered).
        Raises WeightSyncError listing each problem (generation stays paused)."""
        if checked:
            return self._verify(sent, recorded, draft_sent)
        if self._external_draft_checksums is not None:
            return self._verify_between(sent, draft_sent)
        return self._skip_check()

    def recorder(self) -> "Recorded":
        """What the value check needs of the sent tensors: a sample of leading rows, and (CPU engines only,
        the one place SGLang's checksum is reproducible here) the checksum SGLang computes of every served tensor."""
        on_cpu = self.engine_device == "cpu"
        roles = sglang_params.sync_roles(self.hf_config, self.engine_dtype, mtp_draft=self.plan.mtp is not None)
        draft_role = sglang_params.separate_draft_role(self.spec.algorithm, self.engine_dtype)
        checksums = sglang_params.ServedChecksums(roles) if on_cpu and roles else None
        draft = sglang_params.ServedChecksums(draft_role) if on_cpu and self.plan.draft and draft_role else None
        return Recorded(readback.ValueSample(self.engine_dtype, self.check_sample), checksums, draft)

    def read_baseline(self) -> None:
        """What every engine serves before this syncer's first update (the checkpoint, for a fresh engine)."""
        self._checkpoint = {c.url: served_state.read_served(c, self.session) for c in self.clients}
        self._verified = dict(self._checkpoint)

    def judge_engines(self, stuck: Sequence[str] = ()) -> list[served_state.EngineVerdict]:
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
                now = served_state.read_served(client, self.session)
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

    # ---- verification ----
    def _verify(self, sent: set[str], recorded: "Recorded | None", draft_sent: set[str]) -> dict[str, int]:
        """Check every engine; raise WeightSyncError listing each problem (generation stays paused)."""
        roles = {"target", "draft"} if self.plan.mtp is not None else {"target"}
        problems, written, states = [], {}, {}
        self.last_value_checks = []
        for client in self.clients:
            try:
                reply = post_all([client], "/weights_checker",
                                 protocol.checksum_payload("all", self.session))[0]
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


def _draft_only(served: dict[str, dict[str, str]]) -> dict[str, str]:
    return {f"{role}.{name}": c for role, names in served.items() if role != "target" for name, c in names.items()}
