"""How a bucket of HF-named tensors reaches the engines: distributed, tensor or disk.

A transport is `start()` (once per sync), `send(bucket, selector, weight_version)` per bucket (returns
the engines' replies, where `engine_seconds` finds the embedded engine's own timing),
`finish(weight_version)`, and `close()` at shutdown; the session (begin/end), pausing and
verification are the syncer's job (sync.py).

- distributed: the trainer's rank 0 and every engine form one process group through
  `/init_weights_update_group` (trainer = rank 0, engine i's TP rank r = rank_offset_i + r); per bucket
  every engine gets `/update_weights_from_distributed` (names, dtypes, shapes) while rank 0 broadcasts
  each tensor in that order. nccl on GPU, gloo on CPU.
- tensor (colocated): `/update_weights_from_tensor` with each bucket flattened into one tensor
  (`load_format: "flattened_bucket"`, as upstream slime sends it) and serialized the way SGLang's
  MultiprocessingSerializer reads it (pickle, base64 over HTTP), one entry per engine TP rank, each
  serialized on its own; a CUDA bucket as one IPC handle naming the device by UUID. With per-rank buckets
  (colocated.py) entry r is the bucket of the trainer rank on engine TP rank r's GPU.
- disk: the whole model written as an HF checkpoint (safetensors shards + index + the original
  config/tokenizer files), then `/update_weights_from_disk`. One request per sync, so all-or-nothing.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import pickle
import shutil
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

from slime_spec.engines.client import EngineClient, EngineGroupError, post_all
from slime_spec.weight_sync import protocol
from slime_spec.weight_sync.gather import Bucket

logger = logging.getLogger(__name__)

HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the spelling SGLang's receiver feeds to getattr(torch, ...)."""
    return str(dtype).removeprefix("torch.")


class DistributedTransport:
    name = "distributed"

    def __init__(self, clients: Sequence[EngineClient], master_address: str, master_port: int, *,
                 backend: str = "gloo", group_name: str = "weight_update_group", engine_tp_size: int = 1,
                 session: bool = True, timeout_s: float = 300.0):
        self.clients, self.master_address, self.master_port = list(clients), master_address, int(master_port)
        self.backend, self.group_name, self.engine_tp_size = backend, group_name, int(engine_tp_size)
        self.session, self.timeout_s = session, timeout_s
        self.world_size = 1 + len(self.clients) * self.engine_tp_size
        self.group = None

    def start(self) -> None:
        self.connect()

    def finish(self, weight_version: str | None) -> None:
        pass

    def connect(self) -> None:
        """Form the group: every engine POSTs block until all ranks join, so rank 0 joins meanwhile."""
        from slime_spec.dist_group import WeightUpdateGroup

        if self.group is not None:
            return

        def payload(i: int) -> dict:
            return protocol.init_group_payload(self.master_address, self.master_port, 1 + i * self.engine_tp_size,
                                               self.world_size, self.group_name, self.backend)

        posts = BackgroundCall(lambda: post_all(self.clients, "/init_weights_update_group", payload))
        try:
            self.group = WeightUpdateGroup(self.master_address, self.master_port, rank=0,
                                           world_size=self.world_size, group_name=self.group_name,
                                           backend=self.backend, timeout_s=self.timeout_s)
        finally:
            posts.join()
        posts.result()

    def send(self, bucket: Bucket, selector: protocol.Selector, weight_version: str | None) -> list[dict]:
        tensors = [t.tensor.to("cuda") if self.backend == "nccl" else t.tensor for t in bucket.tensors]
        payload = protocol.distributed_payload(
            bucket.names, [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors],
            group_name=self.group_name, selector=selector, weight_version=weight_version,
            flush_cache=False, session=self.session)
        posts = BackgroundCall(lambda: post_all(self.clients, "/update_weights_from_distributed", payload))
        broken = False
        try:
            for t in tensors:
                self.group.broadcast(t, src=0)
        except BaseException:
            # A member is gone (an engine died mid-sync): a collective with a dead member never completes, so
            # this side leaves the group now and the next sync forms a new one.
            broken = True
            self.group.destroy()
            raise
        finally:
            posts.join()
            if broken:
                self._drop_broken_group()
        return posts.result()

    def _drop_broken_group(self) -> None:
        """After a failed broadcast: the engines leave the group too, and the next sync forms a new one. An engine
        that is gone, or dropped the group already, cannot leave it: said in the log, the broadcast's error is
        the one raised."""
        self.group = None
        try:
            post_all(self.clients, "/destroy_weights_update_group", protocol.destroy_group_payload(self.group_name))
        except EngineGroupError as e:
            logger.warning("after a failed broadcast, leaving the weight-update group failed on %d engine(s): %s",
                           len(e.failures), e)

    def close(self) -> None:
        """Leave the group here and on every engine at once, as it was formed: NCCL's teardown waits for every
        rank, so an engine's `/destroy_weights_update_group` returns only once this side destroys too. Both are
        bounded (dist_group.DESTROY_TIMEOUT_S, or the group's timeout if shorter): GroupCloseTimeout names what
        did not finish. This side's group is dropped even if an engine fails (a restarted engine has no group any
        more); the engines' error (EngineGroupError) is raised after."""
        from slime_spec.dist_group import DESTROY_TIMEOUT_S, GroupCloseTimeout

        if self.group is None:
            return
        group, self.group = self.group, None
        timeout_s = min(self.timeout_s, DESTROY_TIMEOUT_S)
        posts = BackgroundCall(lambda: post_all(self.clients, "/destroy_weights_update_group",
                                                protocol.destroy_group_payload(self.group_name)))
        try:
            group.destroy(timeout_s)
        finally:
            answered = posts.join(timeout_s)
        if not answered:
            raise GroupCloseTimeout(
                f"the engines did not answer /destroy_weights_update_group of group {self.group_name!r} within "
                f"{timeout_s:g} s (this side left the group): an engine stuck in its teardown or busy elsewhere; "
                f"restart it, or set NCCL_CUMEM_ENABLE=0 in it (then its teardown waits for no peer)")
        posts.result()


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One TP rank's entry of `serialized_named_tensors`: what SGLang's MultiprocessingSerializer.deserialize
    (its SafeUnpickler) reads back, a pickle of [(name, tensor)] in base64.

    CPU tensors are pickled with their bytes inline, which any process can read (torch's shared-memory
    CPU path needs a file-descriptor handshake between related processes). CUDA tensors travel as CUDA
    IPC handles, zero copy, naming the device by UUID as SGLang's `monkey_patch_torch_reductions` does
    on both sides, so the engine opens the handle on its own GPU whatever its device numbering. The
    caller must keep the tensors alive until the engine has replied (the engine copies from them).
    """
    buf = io.BytesIO()
    if any(t.is_cuda for _, t in named):
        cuda_ipc_pickler(buf).dump([(n, t.detach()) for n, t in named])
    else:
        pickle.dump([(n, compact(t)) for n, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_for_tp_ranks(named: list[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """`serialized_named_tensors` for one engine: entry r is TP rank r's, and each rank reads only its own.

    Every entry is serialized on its own: a CUDA IPC handle is reference-counted per deserialization,
    so ranks must not share one (SGLang's tp_worker.deserialize_own_rank says the same).
    """
    if tp_size < 1:
        raise ValueError(f"engine tp size must be >= 1, got {tp_size}: pass the engines' --tp-size")
    return [serialize_named_tensors(named) for _ in range(tp_size)]


def _reduce_cuda_tensor_by_uuid(tensor: torch.Tensor):
    """torch's CUDA IPC reduction with the device index replaced by the device UUID (argument 6 of
    `rebuild_cuda_tensor`), the form SGLang's patched `rebuild_cuda_tensor` maps back to a local device."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        device = args[CUDA_DEVICE_ARG]
        args = (*args[:CUDA_DEVICE_ARG], str(torch.cuda.get_device_properties(device).uuid),
                *args[CUDA_DEVICE_ARG + 1:])
    return rebuild, args


CUDA_DEVICE_ARG = 6  # position of the device index in rebuild_cuda_tensor's arguments (torch 2.x)


def cuda_ipc_pickler(buf: io.BytesIO):
    """A ForkingPickler whose tensor reduction names devices by UUID; torch's global reductions stay as they are."""
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
    from multiprocessing.reduction import ForkingPickler

    pickler = ForkingPickler(buf)
    pickler.dispatch_table = {**pickler.dispatch_table, torch.Tensor: _reduce_cuda_tensor_by_uuid,
                              torch.nn.Parameter: _reduce_cuda_tensor_by_uuid}
    return pickler


def compact(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes: pickling a view would carry its whole storage (e.g. a padded vocab)."""
    t = t.detach().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


FLATTENED_BUCKET = "flattened_bucket"


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> dict:
    """The `{"flattened_tensor", "metadata"}` object SGLang's `_update_weights_from_flattened_bucket` reads: every
    tensor's bytes in one uint8 tensor on their device, and SGLang's own FlattenedTensorMetadata per tensor.

    Wider dtypes come first, so every tensor starts at a multiple of its element size (the receiver views each
    byte range as its dtype, which needs that alignment); the order of names does not matter to a load.
    """
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    if not named:
        raise ValueError("cannot flatten an empty bucket")
    ordered = sorted(named, key=lambda nt: -nt[1].element_size())
    parts, metadata, offset = [], [], 0
    for name, t in ordered:
        flat = t.detach().reshape(-1).view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                                                end_idx=offset + flat.numel(), numel=flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def serialize_flattened(obj: dict, tp_size: int) -> list[str]:
    """`serialized_named_tensors` of one flattened bucket, one entry per engine TP rank (each its own handle)."""
    if tp_size < 1:
        raise ValueError(f"engine tp size must be >= 1, got {tp_size}: pass the engines' --tp-size")
    return [_serialize(obj, obj["flattened_tensor"].is_cuda) for _ in range(tp_size)]


def stage_bucket(named: list[tuple[str, torch.Tensor]], flatten: bool):
    """What an engine reads out of this process for one bucket: the bucket flattened into one tensor (one device
    copy here, one IPC handle there) or the tensors as they are. The engine reads from another process, so on
    CUDA the bytes are written (device sync) before this returns. Keep it alive until the engines have replied."""
    staged = flatten_bucket(named) if flatten else named
    cuda = next((t.device for _, t in named if t.is_cuda), None)
    if cuda is not None:
        torch.cuda.synchronize(cuda)
    return staged


def serialize_bucket(staged, flatten: bool, count: int) -> list[str]:
    """`count` entries of `serialized_named_tensors` of a staged bucket, each serialized on its own (a CUDA IPC
    handle is opened by one reader only): one per engine TP rank, or one for this trainer rank's own entry."""
    return serialize_flattened(staged, count) if flatten else serialize_for_tp_ranks(staged, count)


def _serialize(obj, cuda: bool) -> str:
    buf = io.BytesIO()
    if cuda:
        cuda_ipc_pickler(buf).dump(obj)
    else:
        pickle.dump(obj, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class TensorTransport:
    """Colocated: the engine copies each bucket out of the trainer's own memory (CUDA IPC on GPU).

    `flatten=True` (the default) sends one flat tensor per bucket (`load_format: "flattened_bucket"`): one IPC
    handle for the engine to open, at the price of one device copy on this side; `flatten=False` sends every
    tensor as it is (no load_format: the model's own loader; one handle per tensor's storage, no copy here).
    Per sync (reset by `start`): `flatten_s` and `serialize_s`, this side's seconds, the part of a send that is
    neither HTTP nor the engine's (the engine's rollback snapshot is in the sync's split: `engine_snapshot_s`).
    """

    name = "tensor"

    def __init__(self, clients: Sequence[EngineClient], *, engine_tp_size: int = 1, session: bool = True,
                 flatten: bool = True, rank_buckets=None):
        self.clients, self.engine_tp_size, self.session = list(clients), int(engine_tp_size), session
        self.rank_buckets = rank_buckets  # colocated.RankBuckets: entry r from trainer rank r; None: all from rank 0
        self.load_format = FLATTENED_BUCKET if flatten else None
        self.flatten_s = self.serialize_s = 0.0

    def start(self) -> None:
        self.flatten_s = self.serialize_s = 0.0

    def finish(self, weight_version: str | None) -> None:
        """Hand back the device memory of buckets the engines have released (torch keeps a block that was shared
        over CUDA IPC until the receiver lets it go)."""
        if self.rank_buckets is not None:
            self.rank_buckets.finish()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()

    def send(self, bucket: Bucket, selector: protocol.Selector, weight_version: str | None) -> list[dict]:
        """The engine replies only after its copy from our memory completed (on CUDA after a device sync:
        engine/weight_receive.settle), so the bucket may be freed or reused once every engine has replied."""
        if self.rank_buckets is not None:
            return self._send_rank_buckets(bucket, selector, weight_version)
        staged = self._stage(bucket)
        if any(t.tensor.is_cuda for t in bucket.tensors):  # each engine gets its own handles, as each rank does
            return post_all(self.clients, "/update_weights_from_tensor",
                            lambda _: self._payload(self._entries(staged, self.engine_tp_size), selector,
                                                    weight_version))
        # inline bytes: one serialization serves every engine
        return post_all(self.clients, "/update_weights_from_tensor",
                        self._payload(self._entries(staged, self.engine_tp_size), selector, weight_version))

    def _send_rank_buckets(self, bucket: Bucket, selector: protocol.Selector, weight_version: str | None) -> list[dict]:
        """Engine e's entries come from its own GPUs' trainer ranks (colocated.py); every rank keeps its bucket
        until the engines have replied, then `release` lets them drop it. Rank 0 makes its entry as every other
        rank does (stage_bucket, serialize_bucket: colocated.follow_sync)."""
        from slime_spec.weight_sync.colocated import RankFailure

        channel, staged = self.rank_buckets, None
        try:
            staged = self._stage(bucket)
            own = self._entries(staged, 1)[0]
        except Exception as e:  # the other ranks wait in the exchange: fail the bucket there, on every rank
            own = RankFailure(0, repr(e))
        entries = channel.exchange(bucket, own)
        if isinstance(entries, RankFailure):
            channel.release(f"trainer rank {entries.rank}: {entries.message}")
            raise RuntimeError(f"trainer rank {entries.rank} could not hand over its bucket: {entries.message}")
        try:
            replies = post_all(self.clients, "/update_weights_from_tensor", lambda e: self._payload(
                channel.layout.entries_of(e, entries), selector, weight_version))
        except Exception as e:
            channel.release(repr(e))
            raise
        channel.release(None)
        del staged  # every engine replied after its copy: this rank's bucket may go
        return replies

    def _stage(self, bucket: Bucket):
        t0 = time.perf_counter()
        staged = stage_bucket([(t.name, t.tensor) for t in bucket.tensors], self.load_format is not None)
        if self.load_format is not None:
            self.flatten_s += time.perf_counter() - t0
        return staged

    def _entries(self, staged, count: int) -> list[str]:
        t0 = time.perf_counter()
        entries = serialize_bucket(staged, self.load_format is not None, count)
        self.serialize_s += time.perf_counter() - t0
        return entries

    def _payload(self, entries: list[str], selector: protocol.Selector, weight_version: str | None) -> dict:
        return protocol.tensor_payload(entries, selector=selector, weight_version=weight_version, flush_cache=False,
                                       session=self.session, load_format=self.load_format)

    def close(self) -> None:
        pass


class DiskTransport:
    """Each bucket becomes a safetensors shard; `finish` writes the index and asks every engine to load it."""

    name = "disk"

    def __init__(self, clients: Sequence[EngineClient], out_dir: str | Path, hf_checkpoint: str | Path, *,
                 session: bool = True):
        self.clients, self.out_dir, self.hf_checkpoint = list(clients), Path(out_dir), Path(hf_checkpoint)
        self.session = session
        self._weight_map: dict[str, str] = {}

    def start(self) -> None:
        """A fresh checkpoint directory for this sync, with the original config and tokenizer files."""
        if not (self.hf_checkpoint / "config.json").exists():
            raise FileNotFoundError(f"--hf-checkpoint {self.hf_checkpoint} has no config.json to write next to "
                                    "the synced weights")
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        self.out_dir.mkdir(parents=True)
        for name in HF_SIDE_FILES:
            if (self.hf_checkpoint / name).exists():
                shutil.copy2(self.hf_checkpoint / name, self.out_dir / name)
        self._weight_map = {}

    def send(self, bucket: Bucket, selector: protocol.Selector, weight_version: str | None) -> list[dict]:
        from safetensors.torch import save_file

        file = f"model-{len(set(self._weight_map.values())):05d}.safetensors"
        # compact: split views of one fused tensor share storage, which safetensors refuses to write
        save_file({t.name: compact(t.tensor.cpu()) for t in bucket.tensors},
                  str(self.out_dir / file), metadata={"format": "pt"})
        self._weight_map.update({name: file for name in bucket.names})
        return []  # nothing reaches an engine before finish()

    def finish(self, weight_version: str | None) -> None:
        index = {"metadata": {}, "weight_map": dict(sorted(self._weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        post_all(self.clients, "/update_weights_from_disk",
                 protocol.disk_payload(str(self.out_dir.resolve()), weight_version=weight_version,
                                       session=self.session))

    def close(self) -> None:
        pass


def engine_seconds(replies: Sequence[dict]) -> tuple[float, float]:
    """(receive, load) seconds of one update, the slowest engine's (they work side by side), from the embedded
    engine's `slime_spec_engine_timing` reply field (a slime-spec extension); (0, 0) where no engine reports it."""
    return engine_timing(replies, "receive_s"), engine_timing(replies, "load_s")


def engine_timing(replies: Sequence[dict], key: str) -> float:
    """The slowest engine's `slime_spec_engine_timing[key]` of one update; 0 where no engine reports it."""
    timings = [r.get("slime_spec_engine_timing") for r in replies if isinstance(r, dict)]
    return max((float(t.get(key, 0.0)) for t in timings if isinstance(t, dict)), default=0.0)


class BackgroundCall:
    """Run a call in a thread; `result()` re-raises its error. Used for POSTs that block on a collective."""

    def __init__(self, fn):
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # re-raised in result(), on the caller's thread
            self._error = e

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the call (at most `timeout_s`); whether it finished."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self):
        if self._error is not None:
            raise self._error
        return self._result
