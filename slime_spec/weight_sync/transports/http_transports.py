"""How a bucket of HF-named tensors reaches the engines: distributed, tensor or disk.

A transport is `start()` (once per sync); per bucket `stage(bucket)` (made ready to post: flattened, on the
device the wire needs) and `post(staged, selector, weight_version, flush_cache)`, which returns an `InFlight` whose
`wait()` gives the engines' replies (where `engine_seconds` finds the embedded engine's own timing; `send` is all
three); `finish(weight_version)`; and `close()` at shutdown. The session (begin/end), pausing and verification are
the syncer's job (sync.py). The distributed and the (single-rank) tensor transport post without waiting for the
replies, so the syncer gathers and stages the next bucket while this one is in flight: up to two buckets are held.

- distributed: the trainer's rank 0 and every engine form one process group through
  `/init_weights_update_group` (trainer = rank 0, engine i's TP rank r = rank_offset_i + r); per bucket
  every engine gets `/update_weights_from_distributed` (names, dtypes, shapes) while rank 0 broadcasts
  each tensor in that order, or (`flatten=True`, SGLang >= 0.5.23) the bucket flattened into one tensor and
  broadcast once (`load_format: "flattened_bucket"`, laid out as SGLang's FlattenedTensorBucket.empty reads it).
  nccl on GPU, gloo on CPU.
- tensor (colocated): `/update_weights_from_tensor` with each bucket flattened into one tensor
  (`load_format: "flattened_bucket"`, as upstream slime sends it) and serialized the way SGLang's
  MultiprocessingSerializer reads it (pickle, base64 over HTTP; weight_sync/transports/tensor_payload.py), one entry
  per engine TP
  rank, each serialized on its own; a CUDA bucket as one IPC handle naming the device by UUID. With per-rank buckets
  (weight_sync/transports/colocated.py) entry r is the bucket of the trainer rank on engine TP rank r's GPU.
- disk: the whole model written as an HF checkpoint (safetensors shards + index + the original
  config/tokenizer files), then `/update_weights_from_disk`. One request per sync, so all-or-nothing.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from slime_spec.common.errors import StructuredError
from slime_spec.common.net import listen_host, listen_socket
from slime_spec.fleet.client import EngineClient, EngineGroupError, post_all
from slime_spec.weight_sync import protocol
from slime_spec.weight_sync.gather import Bucket
from slime_spec.weight_sync.transports.colocated import RankFailure
from slime_spec.weight_sync.transports.tensor_payload import (
    FLATTENED_BUCKET,
    compact,
    flatten_bucket,
    serialize_bucket,
    stage_bucket,
)

logger = logging.getLogger(__name__)

HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the spelling SGLang's receiver feeds to getattr(torch, ...)."""
    return str(dtype).removeprefix("torch.")


# After a failed broadcast: how long the engines get to answer once this side has left the group (gloo ends their
# receives at once; an engine still silent is stuck in the broken collective, as an NCCL receive is).
BROKEN_GROUP_REPLY_S = 30.0


class BroadcastStuck(StructuredError):
    """A broadcast failed and engines at `urls` are still stuck in it: they serve nothing until restarted."""

    def __init__(self, urls: list[str], message: str):
        super().__init__(message)
        self.urls = list(urls)


def broadcast_plan(named: list[tuple[str, torch.Tensor]], flatten: bool
                   ) -> tuple[list[tuple[str, torch.dtype, list[int]]], list[torch.Tensor]]:
    """What one bucket puts on the wire: (name, dtype, shape) per tensor, in the order the receiver reads them, and
    the tensors rank 0 broadcasts in that order. Flattened: one uint8 tensor laid out as SGLang's
    `FlattenedTensorBucket.empty(names, dtypes, shapes)` allocates it (wider dtypes first, so every tensor starts at
    a multiple of its element size, which that receiver checks)."""
    if not flatten:
        return [(n, t.dtype, list(t.shape)) for n, t in named], [t for _, t in named]
    flat = flatten_bucket(named)
    return [(m.name, m.dtype, list(m.shape)) for m in flat["metadata"]], [flat["flattened_tensor"]]


class DistributedTransport:
    name = "distributed"

    def __init__(self, clients: Sequence[EngineClient], master_address: str, *,
                 backend: str = "gloo", group_name: str = "weight_update_group", engine_tp_size: int = 1,
                 session: bool = True, timeout_s: float = 300.0, flatten: bool = False):
        """flatten: one broadcast per bucket (SGLang's receive then allocates one buffer, not one per tensor) at the
        price of one copy on each side; needs SGLang >= 0.5.23 (the session protocol), whose receiver reads
        `load_format`. Off: one broadcast per tensor, which the embedded engine receives into the parameters.
        Each new group gets a port of its own, listened on before any engine is told it."""
        if flatten and not session:
            raise ValueError("a flattened bucket over update_weights_from_distributed needs SGLang >= 0.5.23 (the "
                             "session protocol): this engine has none; send tensor by tensor (flatten=False)")
        self.flatten = flatten
        self.clients, self.master_address = list(clients), master_address
        self.backend, self.group_name, self.engine_tp_size = backend, group_name, int(engine_tp_size)
        self.session, self.timeout_s = session, timeout_s
        self.world_size = 1 + len(self.clients) * self.engine_tp_size
        self.group = None
        self.group_port: int | None = None  # the port the current group was formed on

    def start(self) -> None:
        self.connect()

    def finish(self, weight_version: str | None) -> None:
        pass

    def connect(self) -> None:
        """Form the group: every engine POSTs block until all ranks join, so rank 0 joins meanwhile."""
        from slime_spec.common.dist_group import WeightUpdateGroup
        if self.group is not None:
            return
        listener = listen_socket(listen_host(self.master_address))
        port = self.group_port = listener.getsockname()[1]

        def payload(i: int) -> dict:
            return protocol.init_group_payload(self.master_address, port, 1 + i * self.engine_tp_size,
                                               self.world_size, self.group_name, self.backend)

        posts = BackgroundCall(lambda: post_all(self.clients, "/init_weights_update_group", payload))
        try:
            self.group = WeightUpdateGroup(self.master_address, port, rank=0, world_size=self.world_size,
                                           group_name=self.group_name, backend=self.backend,
                                           timeout_s=self.timeout_s, listener=listener)
        finally:
            posts.join()
        posts.result()

    def send(self, bucket: Bucket, selector: protocol.Selector, weight_version: str | None,
             flush_cache: bool = False) -> list[dict]:
        return self.post(self.stage(bucket), selector, weight_version, flush_cache).wait()

    def stage(self, bucket: Bucket) -> "StagedBucket":
        """What goes on the wire: (name, dtype, shape) per tensor as the receiver reads them, and the tensors to
        broadcast (on the GPU for NCCL; flattened into one where `flatten`)."""
        named = [(t.name, t.tensor.to("cuda") if self.backend == "nccl" else t.tensor) for t in bucket.tensors]
        specs, wire = broadcast_plan(named, self.flatten)
        return StagedBucket(bucket, (specs, wire))

    def post(self, staged: "StagedBucket", selector: protocol.Selector, weight_version: str | None,
             flush_cache: bool = False) -> "InFlight":
        """Ask every engine to receive the bucket and queue its broadcast; returns before the engines reply (NCCL
        queues the broadcast on its stream; gloo's returns once sent), holding the bucket until they have."""
        specs, wire = staged.wire
        payload = protocol.distributed_payload(
            [n for n, _, _ in specs], [dtype_name(d) for _, d, _ in specs], [shape for _, _, shape in specs],
            group_name=self.group_name, selector=selector, weight_version=weight_version,
            flush_cache=flush_cache, session=self.session, load_format=FLATTENED_BUCKET if self.flatten else None)
        posts = PostEach(self.clients, "/update_weights_from_distributed", payload)
        try:
            for t in wire:
                self.group.broadcast(t, src=0)
        except BaseException as e:
            self._leave_broken_group(posts, e)  # raises
        return InFlight(posts, holds=staged)

    def _leave_broken_group(self, posts: "PostEach", error: BaseException) -> None:
        """After a failed broadcast (a member is gone: a collective with a dead member never completes): leave the
        group here, which ends the engines' receives at once with gloo (dist_group.GroupBroken), wait a bounded time
        for their replies, and have those that answered leave it too; the next sync forms a new group. An NCCL
        receive cannot tell that a peer is gone (it waits out the group's timeout, 30 min by SGLang's default): an
        engine still silent after BROKEN_GROUP_REPLY_S is named in BroadcastStuck, to be restarted, and is asked
        nothing more. Otherwise the broadcast's error is the one raised; an engine that cannot leave the group
        (gone, or it dropped the group already) is said in the log."""
        from slime_spec.common.dist_group import GroupCloseTimeout
        group, self.group = self.group, None
        try:
            if group is not None:
                group.destroy()
        except GroupCloseTimeout as e:  # its communicator was aborted: this side has left all the same
            logger.warning("after a failed broadcast: %s", e)
        wait_s = min(self.timeout_s, BROKEN_GROUP_REPLY_S)
        stuck = posts.join(wait_s)
        answered = [c for c in self.clients if c.url not in stuck]
        try:
            if answered:
                post_all(answered, "/destroy_weights_update_group", protocol.destroy_group_payload(self.group_name))
        except EngineGroupError as e:
            logger.warning("after a failed broadcast, leaving the weight-update group failed on %d engine(s): %s",
                           len(e.failures), e)
        if stuck:
            raise BroadcastStuck(stuck, f"a broadcast of weight-update group {self.group_name!r} failed ({error}); "
                                        f"engine(s) {', '.join(stuck)} did not answer /update_weights_from_distributed "
                                        f"within {wait_s:g} s after this side left the group: they still wait in the "
                                        "broken collective for a member that is gone. Restart them") from error
        raise error

    def close(self) -> None:
        """Leave the group here and on every engine at once, as it was formed: NCCL's teardown waits for every
        rank, so an engine's `/destroy_weights_update_group` returns only once this side destroys too. Both are
        bounded (dist_group.DESTROY_TIMEOUT_S, or the group's timeout if shorter): GroupCloseTimeout names what
        did not finish. This side's group is dropped even if an engine fails (a restarted engine has no group any
        more); the engines' error (EngineGroupError) is raised after."""
        from slime_spec.common.dist_group import DESTROY_TIMEOUT_S, GroupCloseTimeout
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

    def send(self, bucket: Bucket, selector: protocol.Selector, weight_version: str | None,
             flush_cache: bool = False) -> list[dict]:
        return self.post(self.stage(bucket), selector, weight_version, flush_cache).wait()

    def stage(self, bucket: Bucket) -> "StagedBucket":
        """The bucket as the engines will read it (flattened: one device copy; on CUDA written before this returns).
        With per-rank buckets every rank stages its own in the exchange, at post."""
        return StagedBucket(bucket, None if self.rank_buckets is not None else self._stage(bucket))

    def post(self, staged: "StagedBucket", selector: protocol.Selector, weight_version: str | None,
             flush_cache: bool = False) -> "InFlight":
        """The engine replies only after its copy from our memory completed (on CUDA after a device sync:
        engine/weight_receive.settle), so the bucket is held until every engine has replied. Per-rank buckets are
        exchanged with the other trainer ranks and answered before this returns."""
        closing = dict(weight_version=weight_version, flush_cache=flush_cache)
        if self.rank_buckets is not None:
            return InFlight.answered(self._send_rank_buckets(staged.bucket, selector, closing))
        if any(t.tensor.is_cuda for t in staged.bucket.tensors):  # each engine its own handles, as each rank has
            entries = [self._entries(staged.wire, self.engine_tp_size) for _ in self.clients]
            payload = lambda i: self._payload(entries[i], selector, closing)  # noqa: E731
        else:  # inline bytes: one serialization serves every engine
            payload = self._payload(self._entries(staged.wire, self.engine_tp_size), selector, closing)
        return InFlight(PostEach(self.clients, "/update_weights_from_tensor", payload), holds=staged)

    def _send_rank_buckets(self, bucket: Bucket, selector: protocol.Selector, closing: dict) -> list[dict]:
        """Engine e's entries come from its own GPUs' trainer ranks (weight_sync/transports/colocated.py); every rank
        keeps its bucket
        until the engines have replied, then `release` lets them drop it. Rank 0 makes its entry as every other
        rank does (stage_bucket, serialize_bucket: colocated.follow_sync)."""
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
                channel.layout.entries_of(e, entries), selector, closing))
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

    def _payload(self, entries: list[str], selector: protocol.Selector, closing: dict) -> dict:
        """closing: this update's `weight_version` and `flush_cache` (set on a sync's last update only)."""
        return protocol.tensor_payload(entries, selector=selector, session=self.session,
                                       load_format=self.load_format, **closing)

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

    def stage(self, bucket: Bucket) -> "StagedBucket":
        return StagedBucket(bucket)

    def post(self, staged: "StagedBucket", selector: protocol.Selector, weight_version: str | None,
             flush_cache: bool = False) -> "InFlight":
        """Written to its shard at once; the engines load every shard in finish()."""
        return InFlight.answered(self.send(staged.bucket, selector, weight_version))

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
    timings = [reported_timing(r) for r in replies if isinstance(r, dict)]
    return max((float(t.get(key, 0.0)) for t in timings if isinstance(t, dict)), default=0.0)


TIMING_TAG = "slime_spec_engine_timing="  # as the embedded engine writes it (engine/weights/receive.py)


def reported_timing(reply: dict) -> dict | None:
    """The embedded engine's timing of one update: the reply's `slime_spec_engine_timing` field, or the JSON object
    after TIMING_TAG in its message (SGLang's reply structs carry only success and message); None on SGLang."""
    field = reply.get("slime_spec_engine_timing")
    if isinstance(field, dict):
        return field
    message = reply.get("message")
    at = message.find(TIMING_TAG) if isinstance(message, str) else -1
    if at < 0:
        return None
    try:
        timing, _ = json.JSONDecoder().raw_decode(message, at + len(TIMING_TAG))
    except ValueError:
        return None
    return timing if isinstance(timing, dict) else None


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

    def error(self) -> BaseException | None:
        return self._error

    def result(self):
        if self._error is not None:
            raise self._error
        return self._result


@dataclass
class StagedBucket:
    """A bucket made ready to post; `wire` is what its transport sends (its own form: see each `stage`)."""

    bucket: Bucket
    wire: Any = None


class InFlight:
    """One bucket's update requests, posted: `wait()` gives every engine's reply (EngineGroupError naming those
    that failed), `settle(timeout_s)` waits without raising. Holds the bucket's tensors until the replies are in
    (an engine replies once its receive has completed)."""

    def __init__(self, posts: "PostEach | None", holds=None, replies: list[dict] | None = None):
        self._posts, self._holds, self._replies = posts, holds, replies

    @classmethod
    def answered(cls, replies: list[dict]) -> "InFlight":
        return cls(None, replies=replies)

    def wait(self) -> list[dict]:
        if self._posts is not None:
            self._posts.join()
            self._replies, self._posts, self._holds = self._posts.result(), None, None
        return self._replies

    def settle(self, timeout_s: float) -> str | None:
        """While another failure is handled: wait at most `timeout_s` for the replies; None if every engine
        answered with success, else what went wrong (for the caller's error message)."""
        if self._posts is None:
            return None
        silent = self._posts.join(timeout_s)
        if silent:
            return f"no reply from {', '.join(silent)} within {timeout_s:g} s"
        try:
            self.wait()
        except EngineGroupError as e:
            return str(e)
        return None


class PostEach:
    """One POST per engine, each on its own thread (they block on a collective), so a caller that stops waiting
    knows which engines have not answered."""

    def __init__(self, clients: Sequence[EngineClient], path: str, payload: dict | Callable[[int], dict]):
        """payload: one body for every engine, or engine i's body as payload(i) (as post_all)."""
        self.clients, self.path = list(clients), path
        body = payload if callable(payload) else (lambda _: payload)
        self._calls = [BackgroundCall(lambda c=c, i=i: c.post(path, body(i))) for i, c in enumerate(self.clients)]

    def join(self, timeout_s: float | None = None) -> list[str]:
        """Wait for every reply (at most `timeout_s` in all); the URLs of the engines that have not answered."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for call in self._calls:
            call.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return [c.url for c, call in zip(self.clients, self._calls) if not call.join(0)]

    def result(self) -> list[dict]:
        """Every engine's reply, once all answered; EngineGroupError naming each engine that failed (as post_all)."""
        errors = {c.url: call.error() for c, call in zip(self.clients, self._calls)}
        failures = {url: e for url, e in errors.items() if e is not None}
        if failures:
            raise EngineGroupError(self.path, failures, [url for url, e in errors.items() if e is None]) \
                from next(iter(failures.values()))
        return [call.result() for call in self._calls]
