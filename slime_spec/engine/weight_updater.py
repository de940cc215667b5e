"""The weight updates, as SGLang 0.5.23's SchedulerWeightUpdaterManager runs them, on the engine thread.

Each method takes the EngineCore and the request (SGLang's io_struct as a dict) and returns success and message,
which the scheduler process sends back in SGLang's reply struct. Messages are SGLang's (scheduler_components/weight_updater.py and
model_runner_components/weight_updater.py) except where the embedded engine behaves better:
a failed load leaves the old weights serving (EngineCore.load_weights is all or nothing), and the
message says so instead of SGLang's "partially updated".

Sessions roll back as a whole (weight_session.py). Inside `begin_weight_update` ... `end_weight_update` the
updater keeps a copy of every tensor it overwrites; if any update of the session fails, every tensor the session
wrote is restored at once, later updates of the session are refused, and `end_weight_update` answers
`success: false` saying so. So a sync that fails after some of its buckets landed still leaves
the weights from before `begin_weight_update` serving. `POST /abort_weight_update {}` (a slime-spec
extension; SGLang has no such route) rolls back and closes the open session: the syncer uses it when one
engine of several failed, so that none keeps a partial update (http_server.py carries it to the scheduler). The copies stay on the device while its free
memory allows and go to reusable host buffers otherwise (weight_receive.SnapshotStore).

Inside a session a distributed update lands straight in parameter memory (weight_receive.receive_in_place);
outside one, or for a flattened bucket, it is received into fresh buffers and loaded all or nothing.
Every update result carries `slime_spec_engine_timing` (receive and load seconds; logged, as SGLang's reply
struct has no field for it), and on CUDA is answered only after the device has finished the copies
(weight_receive.settle).

Selector semantics: "target" reaches the target runner, "draft" the draft runner (MiMo MTP layers
for NEXTN/EAGLE, the separate model for STANDALONE, nothing for NGRAM), "all" both; a distributed
update is received once and loaded into every selected runner.

`/update_weights_from_tensor` payloads: one base64 string per TP rank (the embedded engine is rank
0), each a pickle that SGLang's own `MultiprocessingSerializer.deserialize` reads (its SafeUnpickler).
SGLang's producers pickle with ForkingPickler (shared-memory handles, same host); a plain
`pickle.dumps([(name, cpu_tensor), ...])` also deserializes there and carries the bytes inline, which
is what the tensor transport writes (weight_sync/transports.serialize_named_tensors): the same payload
shape, safe across processes on CPU.

Runners (which served tensors a `selector` reaches, by HF name): SGLang fans an update out to the selected
model runners; each loads the names its model has. The MiMo target runner skips `model.mtp_layers.*`; the
MTP draft runner loads those plus the embedding and lm_head it shares with the target; a STANDALONE draft
loads every name it has (so "all" overwrites a same-shaped external draft with target tensors, the hazard
behind slime #1177).
"""

from __future__ import annotations

import functools
import logging
import pickle
import time
from pathlib import Path
from typing import Any

import torch

from slime_spec.dist_group import WeightUpdateGroup
from slime_spec.engine.model import CausalLM, hf_weight_names
from slime_spec.engine.weight_receive import DeviceSpan, EngineTiming, copy_threads, receive_in_place, settle
from slime_spec.engine.weight_session import WeightSession, roles_of

logger = logging.getLogger(__name__)

NOT_IN_SESSION = "{op} must run between begin_weight_update() and end_weight_update()"
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")


# ------------------------------------------------------------------ runners
Runner = dict[str, torch.nn.Parameter]


def select_runners(target: CausalLM, drafter, selector: str) -> list[Runner]:
    if selector not in ("target", "draft", "all"):
        raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
    runners = []
    if selector in ("target", "all"):
        params = dict(target.named_parameters(remove_duplicate=False))
        runners.append({n: params[n] for n in hf_weight_names(target) if not n.startswith("model.mtp_layers.")})
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
        for param in targets:
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != served {tuple(param.shape)}")
            plan.append((param, tensor))
    return plan


# ------------------------------------------------------------------ payloads
def deserialize_named_tensors(payload: Any) -> Any:
    """One rank's entry (base64 str or bytes) -> what the producer pickled, through SGLang's SafeUnpickler.

    torch's CUDA-IPC rebuild is patched first, as SGLang's TP worker does: the producer names its device by UUID
    (weight_sync/transports.py), which the patched rebuild maps to this process's device index."""
    from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payload
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.deserialize(normalize_serialized_named_tensor_payload(payload))


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch dtype name such as 'bfloat16'")
    return dtype


def _unbucket(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """A flattened_bucket payload ({"flattened_tensor", "metadata"}) -> named tensors, as SGLang rebuilds it."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                    end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]]
    return FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=meta).reconstruct_tensors()


def _fails_the_session(op: str):
    """Any error inside an update (a malformed payload included) fails it like a refused load: inside a session
    the session rolls back and end_weight_update answers success: false; the error is logged, never lost."""
    def wrap(method):
        @functools.wraps(method)
        def guarded(self, core, req: dict) -> dict:
            try:
                with copy_threads(self.device):
                    return method(self, core, req)
            except Exception as e:
                logger.exception("%s failed", op)
                out = self._fail_session(core, f"{op} failed: {e!r}. This update was not applied; check the "
                                               "request's fields against SGLang's io_struct.")
                return {**out, "num_paused_requests": 0} if op == "update_weights_from_disk" else out
        return guarded
    return wrap


class WeightUpdater:
    """Session, update groups and weight version of one engine. Every method runs on the engine thread."""

    def __init__(self, weight_version: str, model_path: str, device: str, has_draft: bool):
        self.weight_version = weight_version
        self.model_path = model_path
        self.device = device
        self.has_draft = has_draft
        self.session = WeightSession(device)
        self.groups: dict[str, WeightUpdateGroup] = {}

    # ------------------------------------------------------------------ session
    def begin(self, core, req: dict) -> dict:
        if self.session.open:
            return _result(False, "a weight-update session is already open; call end_weight_update() first")
        self.session.begin(req.get("selector", "all"), self.weight_version)
        return _result(True, "Success")

    def end(self, core, req: dict) -> dict:
        if not self.session.open:
            return _result(False, "no weight-update session is open; call begin_weight_update() first")
        error = self.session.error
        self.session.close()
        if error is not None:
            return {**_result(False, f"the session was rolled back after a failed update ({error}); the weights "
                                     "from before begin_weight_update() keep serving"), "rolled_back": True}
        return _result(True, "Success")

    def abort(self, core, req: dict) -> dict:
        """slime-spec extension: roll back and close the open session (another engine's update failed)."""
        if not self.session.open:
            return {**_result(True, "no weight-update session is open; nothing to roll back"), "rolled_back": False}
        self.weight_version = self.session.version_before
        with copy_threads(self.device):
            restored = self.session.close(core)  # rolled back, then ended
        return {**_result(True, f"rolled back {restored} tensor(s); the weights from before "
                                "begin_weight_update() keep serving"), "rolled_back": True}

    def _fail_session(self, core, message: str) -> dict:
        """A failed update inside a session: restore everything the session wrote, refuse the rest of it."""
        if not self.session.open:
            return _result(False, message)
        self.session.error = message  # refused from here on, even if the rollback itself fails
        self.weight_version = self.session.version_before
        restored = self.session.rollback(core)  # the session stays open and refuses the rest
        return _result(False, f"{message} This session's {restored} earlier tensor write(s) were rolled back: the "
                              "weights from before begin_weight_update() keep serving.")

    def _session_refused(self) -> dict | None:
        if self.session.open and self.session.error is not None:
            return _result(False, "an earlier update of this session failed and was rolled back; call "
                                  "end_weight_update() and sync again in a new session")
        return None

    # ------------------------------------------------------------------ groups
    def init_group(self, core, req: dict) -> dict:
        backend = req.get("backend", "nccl")
        if backend == "nccl" and not self.device.startswith("cuda"):
            return _result(False, "Failed to initialize custom process group: backend 'nccl' needs a CUDA engine "
                                  "and this engine runs on CPU; ask for backend 'gloo'.")
        group_name = req.get("group_name", "weight_update_group")
        if not group_name:
            return _result(False, "Failed to initialize custom process group: Group name cannot be empty.")
        try:
            group = WeightUpdateGroup(req["master_address"], int(req["master_port"]), rank=int(req["rank_offset"]),
                                      world_size=int(req["world_size"]), group_name=group_name, backend=backend)
        except (RuntimeError, ValueError) as e:
            return _result(False, f"Failed to initialize custom process group: {e}.")
        old = self.groups.pop(group_name, None)
        if old is not None:
            old.destroy()
        self.groups[group_name] = group
        return _result(True, "Succeeded to initialize custom process group.")

    def destroy_group(self, core, req: dict) -> dict:
        group = self.groups.pop(req.get("group_name", "weight_update_group"), None)
        if group is None:
            return _result(False, "The group to be destroyed does not exist.")
        group.destroy()
        return _result(True, "Succeeded to destroy custom process group.")

    # ------------------------------------------------------------------ updates
    @_fails_the_session("update_weights_from_distributed")
    def update_from_distributed(self, core, req: dict) -> dict:
        if not self.session.open:
            return _result(False, NOT_IN_SESSION.format(op="update_weights_from_distributed"))
        selector = req.get("selector", "all")
        roles_of(selector)
        timing = EngineTiming()
        if self._session_refused() is None and req.get("load_format") != "flattened_bucket":
            return self._update_in_place(core, req, selector, timing)
        t0 = time.perf_counter()
        try:
            named = self._receive(req)
        except (RuntimeError, ValueError, AssertionError) as e:
            return self._fail_session(core, f"Failed to receive weights: {e}")
        timing.receive_s = time.perf_counter() - t0
        return self._load(core, named, selector, req, "Succeeded to update parameter online.", timing)

    def _update_in_place(self, core, req: dict, selector: str, timing: EngineTiming) -> dict:
        """Validate from names/dtypes/shapes, then broadcast into the parameters (session snapshot first).
        A refused update still drains the broadcast, so rank 0 and the other engines go on."""
        try:
            group, specs, recv_device = self._group_and_specs(req)
        except ValueError as e:
            return self._fail_session(core, f"Failed to receive weights: {e}")
        metas = [torch.empty(shape, dtype=dtype, device="meta") for _, dtype, shape in specs]
        t0 = time.perf_counter()
        try:
            plan = core.plan_weights([(n, m) for (n, _, _), m in zip(specs, metas)], selector)
        except ValueError as e:
            try:
                self._receive(req)
            except (RuntimeError, ValueError, AssertionError) as recv_error:
                e = f"{e}; draining the broadcast failed too: {recv_error}"
            return self._fail_session(core, f"Failed to update parameter online: {e}. This update was not applied.")
        snapshot = self.session.snapshot_for(core, selector, [n for n, _, _ in specs], timing)
        timing.load_s += time.perf_counter() - t0
        try:
            receive_in_place(group, specs, recv_device, plan, metas, snapshot.take, timing)
            t0 = time.perf_counter()
            settle(recv_device)  # on CUDA the broadcasts and copies are queued: wait for them here
            timing.receive_s += time.perf_counter() - t0
        except (RuntimeError, ValueError, AssertionError) as e:
            return self._fail_session(core, f"Failed to receive weights: {e}")
        return {**self._finish_update(core, req, "Succeeded to update parameter online."), **timing.reply_field()}

    def _group_and_specs(self, req: dict) -> tuple[WeightUpdateGroup, list[tuple[str, torch.dtype, list[int]]], str]:
        """The request's group, its (name, dtype, shape) list, and the device the broadcast lands on."""
        group_name = req.get("group_name", "weight_update_group")
        if group_name not in self.groups:
            raise ValueError(f"Group {group_name} not in {list(self.groups)}. Please call "
                             "`init_weights_update_group` first.")
        group = self.groups[group_name]
        names, dtypes, shapes = req["names"], req["dtypes"], req["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes must have the same length, got {len(names)}, "
                             f"{len(dtypes)}, {len(shapes)}")
        specs = [(n, _torch_dtype(d), [int(s) for s in shape]) for n, d, shape in zip(names, dtypes, shapes)]
        return group, specs, self.device if group.backend == "nccl" else "cpu"

    def _receive(self, req: dict) -> list[tuple[str, torch.Tensor]]:
        """One broadcast from rank 0 per tensor into fresh buffers, in the order of names (or one flat bucket),
        as SGLang receives."""
        group, specs, device = self._group_and_specs(req)
        if req.get("load_format") == "flattened_bucket":
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

    @_fails_the_session("update_weights_from_tensor")
    def update_from_tensor(self, core, req: dict) -> dict:
        if not self.session.open:
            return _result(False, NOT_IN_SESSION.format(op="update_weights_from_tensor"))
        selector = req.get("selector", "all")
        roles_of(selector)
        if (refused := self._session_refused()) is not None:
            return refused
        t0 = time.perf_counter()
        payloads = req["serialized_named_tensors"]
        if not isinstance(payloads, list) or not payloads:
            return self._fail_session(core, "serialized_named_tensors must be a non-empty list (one entry per TP rank)")
        try:
            obj = deserialize_named_tensors(payloads[0])
            named = _unbucket(obj) if req.get("load_format") == "flattened_bucket" else list(obj)
        except (RuntimeError, ValueError, TypeError, KeyError, pickle.UnpicklingError) as e:
            return self._fail_session(core, f"Failed to deserialize serialized_named_tensors: {e}")
        if req.get("load_format") not in (None, "direct", "flattened_bucket"):
            return self._fail_session(core, f"Unknown load_format={req.get('load_format')}")
        return self._load(core, named, selector, req, "Success", EngineTiming(receive_s=time.perf_counter() - t0))

    @_fails_the_session("update_weights_from_disk")
    def update_from_disk(self, core, req: dict) -> dict:
        """SGLang reloads every runner from the checkpoint (no selector on this route)."""
        path = Path(req["model_path"])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            out = _result(False, f"Failed to get weights iterator: no *.safetensors in {path}.")
            return {**out, "num_paused_requests": 0}
        from safetensors.torch import load_file

        named = []
        for f in files:
            try:
                named += load_file(str(f)).items()
            except Exception as e:  # safetensors raises its own SafetensorError for a corrupt file
                out = self._fail_session(core, f"Failed to get weights iterator: model_path {path}: {f.name} is not "
                                               f"a readable safetensors file ({e}); point model_path at a complete "
                                               "checkpoint.")
                return {**out, "num_paused_requests": 0}
        out = self._load(core, named, "all", req, "Succeeded to update model weights.")
        if out["success"]:
            self.model_path = str(path)
        return {**out, "num_paused_requests": 0}

    def _load(self, core, named: list[tuple[str, torch.Tensor]], selector: str, req: dict, ok: str,
              timing: EngineTiming | None = None) -> dict:
        """Load received tensors all or nothing; the reply waits until the copies are done (see settle). Every
        route loads here, so here a session whose earlier update failed refuses the rest (a broadcast was still
        received first: it must complete on every rank)."""
        if (refused := self._session_refused()) is not None:
            return refused
        timing = timing or EngineTiming()
        t0 = time.perf_counter()
        snapshot = DeviceSpan(self.device)
        if self.session.open:
            self.session.snapshot_for(core, selector, [n for n, _ in named], timing).take_all()
        snapshot.stop()
        try:
            core.load_weights(named, selector=selector)
            settle(self.device)  # a CUDA-IPC sender may reuse its bucket the moment it reads the reply
        except ValueError as e:
            return self._fail_session(core, f"Failed to update parameter online: {e}. This update was not applied.")
        timing.snapshot_s += snapshot.seconds()
        timing.load_s += time.perf_counter() - t0
        timing.buffered += len(named)
        return {**self._finish_update(core, req, ok), **timing.reply_field()}

    def _finish_update(self, core, req: dict, ok: str) -> dict:
        """SGLang's TokenizerManager records a request's `weight_version` and says so in the message itself."""
        if req.get("weight_version") is not None:
            self.weight_version = req["weight_version"]
        if req.get("flush_cache", True) and not core.flush_cache():
            return _result(False, FLUSH_REFUSED)
        return _result(True, ok)

    # ------------------------------------------------------------------ reads
    def get_weights_by_name(self, core, req: dict) -> list | None:
        """The target runner's tensor as float32 nested lists, its first `truncate_size` rows (SGLang's Llama)."""
        weights = core.named_weights("target")
        name = req["name"]
        if name not in weights and name == "lm_head.weight":
            name = "model.embed_tokens.weight"  # tied embeddings, as SGLang answers
        if name not in weights:
            return None
        t = weights[name]
        t = t[: int(req.get("truncate_size", 100))] if t.dim() else t  # slice before the (slow) list conversion
        return t.float().cpu().tolist()


def _result(success: bool, message: str) -> dict:
    return {"success": success, "message": message}
