"""Weight updates on the embedded engine: SGLang 0.5.23's own SchedulerWeightUpdaterManager over our runners.

The scheduler process hands every weight-update request to `EngineWeights.handle`, which runs it through SGLang's
`SchedulerWeightUpdaterManager` (managers/scheduler_components/weight_updater.py): the session rules (updates only
between begin and end, one session at a time), selector parsing and the fan-out to the selected runners, the
weight-version record, the cache flush after an update, and the reply structs with their messages are SGLang's
code. What that manager calls on the scheduler (its TP worker, spec worker and their model runners) is presented
by engine/weights/workers.py, and each of those calls lands here.

What stays ours, behind that interface:
- One load per update, all or nothing: SGLang's manager calls each selected runner's loader in turn; our engine
  loads an update once for every runner its selector reaches (every name, shape and dtype checked before the first
  copy; MiMo's shared embedding copied once), so the first runner called does the load and the others report its
  result. The runners learn the update's selector from the request being served (`EngineWeights.serving`).
- Rollback (engine/weights/session.py): inside a session every tensor an update overwrites is held first, in a host
  mirror kept current in the background between sessions (engine/weights/mirror.py); if an update fails,
  everything the session wrote is restored, later updates of that session are refused, and the weights from before
  `begin_weight_update` keep serving. SGLang's loaders write in place and a failure answers "partially
  updated". `/end_weight_update` then answers as SGLang's manager does (success: it closes the session).
  `POST /abort_weight_update {}` (a slime-spec extension, carried as an `EndWeightUpdateReqInput` whose rid is
  http_server.ABORT_SESSION_RID) rolls back the open session and closes it through the manager's own end.
- In-place receive: inside a session a distributed update is broadcast straight into parameter memory
  (receive.receive_in_place) instead of SGLang's fresh buffers; on CUDA the reply waits for the copies
  (receive.settle). Each update's receive and load seconds are logged and carried in the reply's message
  (`slime_spec_engine_timing=`, receive.EngineTiming.tagged).
- A request SGLang's manager lets raise (a malformed tensor payload) fails the update and the session instead of
  the scheduler process; the reply says why.

Runners (which served tensors a `selector` reaches, by HF name): the target runner skips the MTP layers (MiMo's
`model.mtp_layers.*`, GLM-4.5's `model.layers.{N + i}`); the MTP draft runner loads those plus the embedding and
lm_head it shares with the target; a STANDALONE draft loads every name it has (so "all" overwrites a same-shaped
external draft with target tensors, the hazard behind slime #1177).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from slime_spec.common.dist_group import WeightUpdateGroup
from slime_spec.engine.entrypoints.http_server import (
    ABORT_SESSION_RID,  # an EndWeightUpdateReqInput with this rid rolls back
    tag_restored_version,
)
from slime_spec.engine.model_executor.model import CausalLM, hf_weight_names
from slime_spec.engine.weights.receive import DeviceSpan, EngineTiming, copy_threads, receive_in_place, settle
from slime_spec.engine.weights.session import WeightSession
from slime_spec.engine.weights.workers import EngineDraftWorker, EngineRunner, EngineTpWorker
from slime_spec.weight_sync import fp8

logger = logging.getLogger(__name__)


# SGLang's request structs this module answers, and the manager method that answers each.
MANAGER_METHODS = {
    "BeginWeightUpdateReqInput": "begin_weight_update",
    "EndWeightUpdateReqInput": "end_weight_update",
    "InitWeightsUpdateGroupReqInput": "init_weights_update_group",
    "DestroyWeightsUpdateGroupReqInput": "destroy_weights_update_group",
    "UpdateWeightsFromDistributedReqInput": "update_weights_from_distributed",
    "UpdateWeightsFromTensorReqInput": "update_weights_from_tensor",
    "UpdateWeightsFromIPCReqInput": "update_weights_from_ipc",
    "UpdateWeightFromDiskReqInput": "update_weights_from_disk",
    "CheckWeightsReqInput": "check_weights",
    "GetWeightsByNameReqInput": "get_weights_by_name",
}
UPDATES = frozenset({"UpdateWeightsFromDistributedReqInput", "UpdateWeightsFromTensorReqInput",
                     "UpdateWeightsFromIPCReqInput", "UpdateWeightFromDiskReqInput"})
# Served once in-flight requests have finished on the old weights (or at once while paused), as SGLang's writer lock.
WHILE_IDLE = UPDATES | {"BeginWeightUpdateReqInput", "EndWeightUpdateReqInput"}


def failure_reply(msg, message: str):
    """SGLang's reply struct for request `msg`, failed with `message`."""
    from sglang.srt.managers import io_struct as io

    kind = type(msg).__name__
    reply_cls = getattr(io, kind.replace("ReqInput", "ReqOutput"))
    if kind == "GetWeightsByNameReqInput":
        return reply_cls(parameter=None)
    extra = {"num_paused_requests": 0} if kind == "UpdateWeightFromDiskReqInput" else {}
    return reply_cls(success=False, message=message, **extra)


# ------------------------------------------------------------------ runners
Runner = dict[str, torch.nn.Parameter]


def select_runners(target: CausalLM, drafter, selector: str, session_cache: dict | None = None) -> list[Runner]:
    """The runners `selector` reaches. `session_cache` (EngineCore.session_runners, set while a weight-update session
    is open) keeps them by (id(drafter), selector): a sync looks them up several times per bucket (the snapshot, the
    load's plan), each walk of a 36-layer model's parameters costs milliseconds, and inside a session the parameter
    objects stay the same (a release or resume swaps their .data only)."""
    if selector not in ("target", "draft", "all"):
        raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
    if session_cache is None:
        return _walk_runners(target, drafter, selector)
    key = (id(drafter), selector)
    if key not in session_cache:
        session_cache[key] = _walk_runners(target, drafter, selector)
    return session_cache[key]


def served_weights_named(core, role: str, names) -> dict[str, torch.Tensor]:
    """The served tensors of `names` (those `role`'s runners have), as `EngineCore.named_weights(role)` has them,
    without detaching every other tensor of the model."""
    runners = select_runners(core.model, core.drafter, role, core.session_runners)
    out = {}
    for name in names:
        param = next((r[name] for r in runners if name in r), None)  # the target's wins, as in named_weights
        if param is not None:
            out[name] = param.detach()
    return out


def _walk_runners(target: CausalLM, drafter, selector: str) -> list[Runner]:
    runners = []
    if selector in ("target", "all"):
        params = dict(target.named_parameters(remove_duplicate=False))
        runners.append({n: params[n] for n in hf_weight_names(target) if not target.is_mtp_weight(n)})
    if selector in ("draft", "all") and drafter is not None:
        draft = drafter.weight_runner()
        if draft is not None:
            runners.append(draft)
    return runners


def named_weights(runners: list[Runner]) -> dict[str, torch.Tensor]:
    """Served tensors by HF name; where a STANDALONE draft shares a name with the target, the target's wins."""
    out: dict[str, torch.Tensor] = {}
    for runner in reversed(runners):
        out.update({n: p.detach() for n, p in runner.items()})
    return out


def plan_load(runners: list[Runner], named: list[tuple[str, torch.Tensor]], *, tied: bool, selector: str,
              algorithm: str | None) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Check every name, shape and dtype and return the (parameter, tensor) copies to make; raise on any error.

    A name no selected runner has is an error. A tied model's `lm_head.weight` is accepted and skipped, as
    SGLang's loaders skip it. A tensor shared by several runners (MiMo's embedding) is copied once.
    """
    plan: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        targets = list({id(r[name]): r[name] for r in runners if name in r}.values())
        if not targets and tied and name == "lm_head.weight" and selector != "draft":
            embed = runners[0]["model.embed_tokens.weight"]
            if tuple(tensor.shape) != tuple(embed.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != served {tuple(embed.shape)}")
            continue
        if not targets:
            raise ValueError(f"{name}: no runner selected by selector={selector!r} has this weight "
                             f"(speculative algorithm {algorithm}); check the name or the selector")
        if not (tensor.is_floating_point() or tensor.dtype == targets[0].dtype):
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be loaded into a {targets[0].dtype} weight")
        if tensor.dtype == fp8.FP8_DTYPE and targets[0].dtype != tensor.dtype:
            raise ValueError(f"{name}: float8_e4m3fn codes without their block scale (weight_scale_inv) cannot be "
                             f"loaded into a {targets[0].dtype} weight; this engine serves an unquantized checkpoint")
        for param in targets:
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != served {tuple(param.shape)}")
            plan.append((param, tensor))
    return plan


# ------------------------------------------------------------------ payloads
def _torch_dtype(name: Any) -> torch.dtype:
    dtype = name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch dtype name such as 'bfloat16'")
    return dtype


def _unbucket(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """A flattened_bucket payload ({"flattened_tensor", "metadata"}) -> named tensors, as SGLang rebuilds it."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                    end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]]
    return FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=meta).reconstruct_tensors()


class Received(list):
    """What `receive_weights_from_distributed` hands SGLang's manager for the runners' loaders: the received
    (name, tensor) pairs, or, when the broadcast landed in the parameters already, `landed` with none to copy."""

    def __init__(self, named=(), *, landed: bool = False, timing: EngineTiming | None = None):
        super().__init__(named)
        self.landed = landed
        self.timing = timing or EngineTiming()


@dataclass
class UpdateCall:
    """The update being served: its selector, and the result of its one load (set by the first runner called)."""

    selector: str
    result: tuple[bool, str] | None = None
    started: float = field(default_factory=time.perf_counter)  # when the engine thread took the request


# ------------------------------------------------------------------ the engine's side
class EngineWeights:
    """SGLang's manager over the embedded engine: session and groups, the update being served, the one load per
    update. Every request is served on the engine thread (EngineCore's only thread)."""

    def __init__(self, core, weight_version: str, device: str):
        self.core, self.device = core, device
        self.weight_version = weight_version
        self.session = WeightSession(device, served=served_weights_named, host=core.memory.host_copy)
        self.groups: dict[str, WeightUpdateGroup] = {}
        self.call: UpdateCall | None = None
        self.last_timing: dict | None = None  # the last update's `slime_spec_engine_timing` (also logged: SGLang's
        # reply structs have no field for it)
        self.tp_worker = EngineTpWorker(self)
        self._tp_cpu_group = _one_rank_group()
        self.manager = self._sglang_manager()

    def _sglang_manager(self):
        from slime_spec.engine import sglang_stand_ins
        sglang_stand_ins.install()
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.runtime_context import get_parallel

        with get_parallel().override(tp_group=_TpGroup(self._tp_cpu_group)):
            return SchedulerWeightUpdaterManager(
                tp_worker=self.tp_worker, draft_worker=EngineDraftWorker(EngineRunner(self, "draft")),
                memory_saver_adapter=None,  # memory release stays the scheduler process's (core.release_memory)
                flush_cache=lambda empty_cache=False: self.core.flush_cache(),
                is_fully_idle=lambda **_: not self.core.has_work(), scheduler=self)

    # ------------------------------------------------------------------ what the manager calls on its scheduler
    def record_weight_version_change(self, new_version: str | None) -> None:
        if new_version is not None:
            self.weight_version = new_version

    # ------------------------------------------------------------------ serving one request
    def handle(self, msg):
        """SGLang's reply struct for one weight-update request (its type name is a key of MANAGER_METHODS)."""
        kind = type(msg).__name__
        try:
            with copy_threads(self.device), self.serving(msg):
                if kind == "BeginWeightUpdateReqInput":
                    return self._begin(msg)
                if kind == "EndWeightUpdateReqInput":
                    return self._abort(msg) if msg.rid == ABORT_SESSION_RID else self._end(msg)
                return getattr(self.manager, MANAGER_METHODS[kind])(msg)
        except Exception as e:  # SGLang's manager lets some raise (a malformed payload); ours answers instead
            logger.exception("%s failed", kind)
            if kind not in UPDATES:
                return failure_reply(msg, f"{e}")
            return failure_reply(msg, self.fail(f"{MANAGER_METHODS[kind]} failed: {e!r}. This update was not applied; "
                                                "check the request's fields against SGLang's io_struct."))

    @contextlib.contextmanager
    def serving(self, msg):
        self.call = UpdateCall(getattr(msg, "selector", None) or "all")
        try:
            yield
        finally:
            self.call = None

    def _begin(self, msg):
        out = self.manager.begin_weight_update(msg)
        if out.success:
            self.session.begin(msg.selector, self.weight_version)
            self.core.session_runners = {}
        return out

    def _end(self, msg):
        out = self.manager.end_weight_update(msg)
        if out.success:
            self.session.close(kept_core=self.core)  # what landed stays, and goes to the host mirror
            self.core.session_runners = None
        return out

    def _abort(self, msg):
        """slime-spec's /abort_weight_update: roll back the open session, then close it with SGLang's end."""
        from sglang.srt.managers.io_struct import EndWeightUpdateReqOutput

        if not self.session.open:
            return EndWeightUpdateReqOutput(success=False, message="no weight-update session is open; nothing to "
                                                                   "roll back")
        self.weight_version = self.session.version_before
        restored = self.session.close(self.core)  # rolled back, then ended
        self.core.session_runners = None
        out = self.manager.end_weight_update(msg)
        message = (f"rolled back {restored} tensor(s); the weights from before begin_weight_update() keep serving, "
                   f"as version {self.weight_version}")
        return EndWeightUpdateReqOutput(success=out.success, message=tag_restored_version(message,
                                                                                          self.weight_version))

    def fail(self, message: str) -> str:
        """A failed update inside a session: restore everything the session wrote, refuse the rest of it; returns
        the message that says so."""
        if not self.session.open:
            return message
        self.session.error = message  # refused from here on, even if the rollback itself fails
        self.weight_version = self.session.version_before
        restored = self.session.rollback(self.core)  # the session stays open and refuses the rest
        return (f"{message} This session's {restored} earlier tensor write(s) were rolled back: the weights from "
                "before begin_weight_update() keep serving.")

    def _replied(self, label: str, timing: EngineTiming, message: str) -> tuple[bool, str]:
        """A successful update's reply, its timing logged and carried in the message (EngineTiming.tagged)."""
        self.last_timing = timing.fields()
        logger.info("%s: %s", label, self.last_timing)
        return True, timing.tagged(message)

    def _refusal(self) -> str | None:
        if self.session.open and self.session.error is not None:
            return ("an earlier update of this session failed and was rolled back; call end_weight_update() and "
                    "sync again in a new session")
        return None

    # ------------------------------------------------------------------ groups
    def init_group(self, req) -> tuple[bool, str]:
        backend = req.backend or "nccl"
        if backend == "nccl" and not self.device.startswith("cuda"):
            return False, ("Failed to initialize custom process group: backend 'nccl' needs a CUDA engine and this "
                           "engine runs on CPU; ask for backend 'gloo'.")
        if not req.group_name:
            return False, "Failed to initialize custom process group: Group name cannot be empty."
        try:
            group = WeightUpdateGroup(req.master_address, int(req.master_port), rank=int(req.rank_offset),
                                      world_size=int(req.world_size), group_name=req.group_name, backend=backend)
        except (RuntimeError, ValueError) as e:
            return False, f"Failed to initialize custom process group: {e}."
        old = self.groups.pop(req.group_name, None)
        if old is not None:
            old.destroy()
        self.groups[req.group_name] = group
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        group = self.groups.pop(group_name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        group.destroy()
        return True, "Succeeded to destroy custom process group."

    # ------------------------------------------------------------------ receiving and loading
    def receive(self, names, dtypes, shapes, group_name, load_format) -> Received:
        """One distributed update's bytes. Inside a healthy session, straight into the parameters the update's
        selector reaches (validated from names, dtypes and shapes first; the session's snapshot taken before each
        first write); else into fresh buffers, as SGLang receives. Raises (the manager answers "Failed to receive
        weights: ...") after failing the session."""
        timing = EngineTiming()
        try:
            if group_name not in self.groups:
                raise ValueError(f"Group {group_name} not in {list(self.groups)}. Please call "
                                 "`init_weights_update_group` first.")
            group = self.groups[group_name]
            if not len(names) == len(dtypes) == len(shapes):
                raise ValueError(f"names, dtypes and shapes must have the same length, got {len(names)}, "
                                 f"{len(dtypes)}, {len(shapes)}")
            specs = [(n, _torch_dtype(d), [int(s) for s in shape]) for n, d, shape in zip(names, dtypes, shapes)]
            recv_device = self.device if group.backend == "nccl" else "cpu"
            t0 = time.perf_counter()
            if load_format != "flattened_bucket" and self.session.open and self._refusal() is None:
                landed = self._receive_in_place(group, specs, recv_device, timing)
                if landed is not None:
                    return landed
            named = _receive_buffers(group, specs, recv_device, load_format)
            timing.receive_s += time.perf_counter() - t0
            return Received(named, timing=timing)
        except (RuntimeError, ValueError, AssertionError) as e:
            raise ValueError(self.fail(f"{e}")) from e

    def _receive_in_place(self, group, specs, recv_device, timing: EngineTiming) -> Received | None:
        """None when the update does not fit what is served: it is then received into buffers and refused by
        the load, naming the tensor (the broadcast completes on every rank either way)."""
        metas = [torch.empty(shape, dtype=dtype, device="meta") for _, dtype, shape in specs]
        t0 = time.perf_counter()
        try:
            plan = self.core.plan_weights([(n, m) for (n, _, _), m in zip(specs, metas)], self.call.selector)
        except ValueError:
            return None
        snapshot = self.session.snapshot_for(self.core, self.call.selector, [n for n, _, _ in specs], timing)
        timing.load_s += time.perf_counter() - t0
        receive_in_place(group, specs, recv_device, plan, metas, snapshot.take, timing)
        t0 = time.perf_counter()
        settle(recv_device)  # on CUDA the broadcasts and copies are queued: wait for them here
        timing.receive_s += time.perf_counter() - t0
        return Received(landed=True, timing=timing)

    def load_once(self, load) -> tuple[bool, str]:
        """The update's one load, by whichever selected runner the manager calls first; the others get its
        result (see the module docstring)."""
        if self.call.result is None:
            self.call.result = load()
        return self.call.result

    def load_received(self, named: Received) -> tuple[bool, str]:
        ok = "Succeeded to update parameter online."
        if named.landed:
            return self._replied("update_weights_from_distributed", named.timing, ok)
        return self._load(list(named), self.call.selector, ok, named.timing, "update_weights_from_distributed")

    def load_tensors(self, named_tensors, load_format) -> tuple[bool, str]:
        if load_format not in (None, "direct", "flattened_bucket"):
            return False, self.fail(f"Unknown load_format={load_format}")
        try:
            named = _unbucket(named_tensors) if load_format == "flattened_bucket" else list(named_tensors)
        except (RuntimeError, ValueError, TypeError, KeyError, AttributeError) as e:
            return False, self.fail(f"Failed to deserialize serialized_named_tensors: {e}")
        # receive: from the engine thread taking the request to here, SGLang's manager deserializing this rank's
        # entry (on CUDA opening the sender's IPC handle) and the unbucketing
        timing = EngineTiming(receive_s=time.perf_counter() - self.call.started)
        return self._load(named, self.call.selector, "Success", timing, "update_weights_from_tensor")

    def load_from_disk(self, model_path: str) -> tuple[bool, str]:
        """Every runner reloads from the checkpoint (SGLang's disk route has no selector)."""
        path = Path(model_path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            return False, self.fail(f"Failed to get weights iterator: no *.safetensors in {path}.")
        from safetensors.torch import load_file

        named = []
        for f in files:
            try:
                named += load_file(str(f)).items()
            except Exception as e:  # safetensors raises its own SafetensorError for a corrupt file
                return False, self.fail(f"Failed to get weights iterator: model_path {path}: {f.name} is not a "
                                        f"readable safetensors file ({e}); point model_path at a complete checkpoint.")
        return self._load(named, "all", "Succeeded to update model weights.", EngineTiming(),
                          "update_weights_from_disk")

    def _load(self, named: list[tuple[str, torch.Tensor]], selector: str, ok: str, timing: EngineTiming,
              label: str) -> tuple[bool, str]:
        """Load tensors all or nothing into every runner `selector` reaches; the reply waits until the copies are
        done (see settle). Every route loads here, so here a session whose earlier update failed refuses the rest
        (a broadcast was still received first: it must complete on every rank)."""
        if (refused := self._refusal()) is not None:
            return False, refused
        t0 = time.perf_counter()
        try:
            named = self.core.dequantized(named)
        except ValueError as e:
            return False, self.fail(f"Failed to update parameter online: {e}. This update was not applied.")
        snapshot = DeviceSpan(self.device)
        if self.session.open:
            self.session.snapshot_for(self.core, selector, [n for n, _ in named], timing).take_all()
        else:  # written outside a session: the mirror no longer equals what is served
            self.session.mirror.invalidate()
        snapshot.stop()
        try:
            self.core.load_weights(named, selector=selector)
            settle(self.device)  # a CUDA-IPC sender may reuse its bucket the moment it reads the reply
        except ValueError as e:
            return False, self.fail(f"Failed to update parameter online: {e}. This update was not applied.")
        timing.snapshot_s += snapshot.seconds()
        timing.load_s += time.perf_counter() - t0
        timing.buffered += len(named)
        return self._replied(label, timing, ok)


def _receive_buffers(group, specs, device: str, load_format) -> list[tuple[str, torch.Tensor]]:
    """One broadcast from rank 0 per tensor into fresh buffers, in the order of names (or one flat bucket), as
    SGLang's model-runner WeightUpdater receives."""
    if load_format == "flattened_bucket":
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        bucket = FlattenedTensorBucket.empty([n for n, _, _ in specs], [d for _, d, _ in specs],
                                             [s for _, _, s in specs], device)
        group.broadcast(bucket.get_flattened_tensor(), src=0)
        return bucket.reconstruct_tensors()
    buffers = [(n, torch.empty(shape, dtype=dtype, device=device)) for n, dtype, shape in specs]
    for _, buf in buffers:
        group.broadcast(buf, src=0)
    settle(device)
    return buffers




@dataclass
class _TpGroup:
    """SGLang's GroupCoordinator as the manager reads it at construction: its CPU group."""

    cpu_group: Any


@functools.lru_cache(maxsize=None)
def _one_rank_group():
    """The embedded engine's TP CPU group (one rank, gloo), on which SGLang's manager places its barriers; one per
    process (torch registers a group name once per process). An in-memory store: one rank needs no rendezvous."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    name = "slime_spec_engine_tp_cpu_group"
    pg, _ = c10d._new_process_group_helper(1, 0, [], c10d.Backend("gloo"), c10d.PrefixStore(name, dist.HashStore()),
                                           group_name=name, timeout=timedelta(seconds=60))
    c10d._world.pg_group_ranks[pg] = {0: 0}  # its one rank is its global rank 0, as collectives look it up
    return pg
