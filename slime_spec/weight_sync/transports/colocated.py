"""Colocated engines with TP > 1: every trainer rank hands the engine TP rank on its own GPU its own bucket.

SGLang 0.5.23's `/update_weights_from_tensor` takes `serialized_named_tensors`, one entry per engine TP rank, and
TP rank r deserializes entry r alone (`TpModelWorker.deserialize_own_rank`): a CUDA IPC handle is opened by one
rank only. Upstream slime (update_weight_from_tensor.py) fills entry r from the trainer rank on the GPU of engine
TP rank r: each trainer rank flattens its own copy of the bucket (every rank holds the full HF tensors after the
TP all-gather), serializes it, and a gloo `gather_object` brings the entries to the rank that posts. The engine's
copy then stays on its own GPU, never reading another GPU's memory.

Layout (as upstream slime places them): the colocated trainer ranks 0..W-1 sit on GPUs 0..W-1, and engine e's
TP rank r on GPU e * engine_tp_size + r, so engine e's entries come from trainer ranks
[e * engine_tp_size, (e + 1) * engine_tp_size) and `W = engines * engine_tp_size`.

`RankBuckets` is one rank's end of the exchange, over a gloo group of those W ranks; group rank 0 (the trainer's
rank 0, which runs the WeightSyncer) leads. Per sync it broadcasts `start` (which tensors are wanted, the bucket
size and format), so every rank buckets its own tensor stream exactly as rank 0 does; per bucket `bucket`
(its names, checked by every rank), then every rank's entry is gathered, rank 0 posts, and it broadcasts the
outcome: every rank keeps its bucket alive until the engines have replied (the engine replies only once its copy
is done), then drops it. A sync ends with `done`, or `abort` when rank 0 failed between buckets; a failed bucket
ends it on every rank at once. The other ranks run `follow_sync`; a failure of their own tensor stream is handed
to rank 0 in the next exchange. The train actor (trainer/actor.py) wires this up with `colocated_rank_buckets`.

Why the group is gloo, on the host, with no host round trip of the weights: on GPU each rank's bucket is made and
kept on its own device (tensor_payload.stage_bucket flattens it there) and its entry is a base64 string naming a
CUDA IPC handle, with the bucket's metadata (KiB, not the bucket's bytes). What the group carries (bucket names,
entries, outcomes) is host objects the HTTP body is made of: gloo moves them as they are, where an NCCL object
collective would copy each pickle to the device and back and queue on the trainer's stream. Only a CPU bucket
travels inline in its entry (bytes in the pickle): a CPU tensor has no handle another process can open
(tensor_payload.serialize_named_tensors), and it is in host memory already.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable

import torch.distributed as dist

from slime_spec.weight_sync.gather import Bucket, NamedTensor, make_buckets, only_wanted_kinds
from slime_spec.weight_sync.transports.tensor_payload import serialize_bucket, stage_bucket

logger = logging.getLogger(__name__)

WAITING, OPEN, ENDED = "waiting", "open", "ended"  # rank 0's view of the other ranks in one sync


@dataclass(frozen=True)
class ColocatedLayout:
    """Which trainer ranks feed which engine: engine e's TP rank r is trainer rank e * engine_tp_size + r."""

    num_engines: int
    engine_tp_size: int

    @classmethod
    def of(cls, trainer_ranks: int, engine_tp_size: int) -> "ColocatedLayout":
        if engine_tp_size < 1 or trainer_ranks % engine_tp_size:
            raise ValueError(f"per-rank colocated buckets need the colocated trainer ranks ({trainer_ranks}) to be a "
                             f"multiple of the engines' --tp-size ({engine_tp_size}): with --colocate every engine TP "
                             "rank shares its GPU with one trainer rank")
        return cls(trainer_ranks // engine_tp_size, engine_tp_size)

    @property
    def world_size(self) -> int:
        return self.num_engines * self.engine_tp_size

    def entries_of(self, engine: int, entries: list[str]) -> list[str]:
        """Engine `engine`'s `serialized_named_tensors`: the entries of the trainer ranks on its GPUs, in TP order."""
        return entries[engine * self.engine_tp_size:(engine + 1) * self.engine_tp_size]


@dataclass(frozen=True)
class RankFailure:
    """What a rank contributes to the gather instead of an entry when it could not make one."""

    rank: int
    message: str


class RankBuckets:
    """One colocated trainer rank's end of the per-rank bucket exchange (see the module docstring)."""

    def __init__(self, group, layout: ColocatedLayout):
        self.group, self.layout = group, layout
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != layout.world_size:
            raise ValueError(f"the per-rank bucket group has {dist.get_world_size(group)} ranks, but "
                             f"{layout.num_engines} engine(s) of --tp-size {layout.engine_tp_size} need "
                             f"{layout.world_size}: build it over every colocated trainer rank")
        self.state = ENDED
        # rank 0: seconds of this sync in `exchange`, waiting for the other ranks to make their entries (their
        # gather, conversion and flatten); the syncer reports it as weight_sync_ranks_wait_s, inside send_s
        self.wait_s = 0.0

    # ---- the messages: rank 0 broadcasts, every rank receives
    def _broadcast(self, message):
        box = [message]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _gather(self, entry) -> list | None:
        out = [None] * self.layout.world_size if self.rank == 0 else None
        dist.gather_object(entry, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out

    # ---- rank 0: next_sync, start, (exchange, release) per bucket, finish; abort on a failure in between
    def next_sync(self) -> None:
        """A sync begins: the other ranks (in follow_sync) now wait for its first message."""
        self.state, self.wait_s = WAITING, 0.0

    def start(self, mtp: bool, draft: bool, buffer_bytes: int, flatten: bool) -> None:
        """Open the sync: the other ranks bucket their streams as rank 0 does (kinds wanted, bucket size, format)."""
        if self.state != WAITING:
            raise RuntimeError("RankBuckets.start without next_sync: the other ranks are not waiting for a sync")
        self.state = ENDED  # until the broadcast is through: a failed collective leaves nothing to abort
        self._broadcast(("start", mtp, draft, int(buffer_bytes), bool(flatten)))
        self.state = OPEN

    def exchange(self, bucket: Bucket, own: str | RankFailure) -> list[str] | RankFailure:
        """Announce `bucket`, gather every rank's entry for it; a RankFailure if any rank could not make one.
        `release` must follow, whatever happens in between."""
        if self.state != OPEN:
            raise RuntimeError("RankBuckets.exchange outside an open sync: call start first")
        self.state = ENDED
        t0 = time.perf_counter()
        self._broadcast(("bucket", bucket.names))
        entries = self._gather(own)
        self.wait_s += time.perf_counter() - t0
        self.state = OPEN
        return next((e for e in entries if isinstance(e, RankFailure)), entries)

    def release(self, error: str | None) -> None:
        """Tell every rank the engines replied (they may drop the bucket), or that the bucket failed (sync over)."""
        self.state = ENDED
        self._broadcast(error)
        if error is None:
            self.state = OPEN

    def finish(self) -> None:
        if self.state == OPEN:
            self.state = ENDED
            self._broadcast(("done",))

    def abort(self, reason: str) -> None:
        """Rank 0 failed outside a bucket exchange: end the sync on every rank (a no-op once it has ended)."""
        if self.state in (WAITING, OPEN):
            self.state = ENDED
            self._broadcast(("abort", reason))


def colocated_rank_buckets(rank: int, world_size: int, num_engines: int, engine_tp_size: int,
                           cuda: bool = False) -> tuple[RankBuckets | None, int]:
    """Every trainer rank calls this once per set of engines (`dist.new_group` is collective over the default
    group): this rank's RankBuckets (None outside the group) and W, the number of colocated trainer ranks that
    hand over buckets (0: rank 0 alone sends, as with one colocated GPU, where there is nothing to spread).

    `cuda`: the trainer's tensors are on GPUs. An engine TP rank on a GPU without a trainer rank of its own is then
    refused: SGLang's update_weights_from_tensor opens a CUDA IPC handle only on a device the engine sees
    (sglang/srt/utils/patch_torch.py raises "Invalid device_uuid"; met on two H200s)."""
    layout = ColocatedLayout(num_engines, engine_tp_size)
    if layout.world_size > world_size and cuda:
        raise ValueError(f"--colocate: {num_engines} engine(s) of --tp-size {engine_tp_size} span {layout.world_size} "
                         f"GPUs but the trainer has {world_size} rank(s), so some engine would read another GPU's "
                         f"weights, which SGLang's update_weights_from_tensor refuses (a CUDA IPC handle opens only on "
                         f"a device the engine sees); give every rollout GPU a trainer rank: --rollout-num-gpus <= "
                         f"--actor-num-nodes x --actor-num-gpus-per-node")
    if world_size < 2 or layout.world_size < 2:
        return None, 0
    if layout.world_size > world_size:  # on the CPU: shared memory, which every engine process can map
        if rank == 0:
            logger.warning("%d engine(s) of --tp-size %d span %d devices but the trainer has %d rank(s): rank 0 "
                           "sends every engine TP rank its bucket; per-rank buckets need --rollout-num-gpus <= "
                           "--actor-num-nodes x --actor-num-gpus-per-node", num_engines, engine_tp_size,
                           layout.world_size, world_size)
        return None, 0
    group = dist.new_group(ranks=list(range(layout.world_size)), backend="gloo")
    return (RankBuckets(group, layout) if rank < layout.world_size else None), layout.world_size


def follow_sync(channel: RankBuckets, tensors: Iterable[NamedTensor]) -> int:
    """A colocated trainer rank other than 0: bucket `tensors` as rank 0 does and hand each bucket's entry over.
    A failure of this rank's own stream (gather, conversion) is handed to rank 0 through the next exchange, so it
    fails that bucket on every rank rather than leave rank 0 waiting. Returns the number of buckets sent; raises
    when rank 0 aborted, a bucket failed, or this rank failed."""
    message = channel._broadcast(None)
    _raise_if_aborted(message)
    _, mtp, draft, buffer_bytes, flatten = message
    buckets = make_buckets(only_wanted_kinds(tensors, mtp=mtp, draft=draft), buffer_bytes)
    sent = 0
    while True:
        bucket, failure = _next_bucket(buckets)
        header = channel._broadcast(None)
        if header[0] == "abort":
            raise RuntimeError(f"weight sync aborted by the trainer's rank 0: {header[1]}") from failure
        if header[0] == "done":
            if failure is not None:
                raise failure
            if bucket is not None:
                raise RuntimeError(f"trainer rank {channel.rank} holds bucket {sent} ({len(bucket.tensors)} tensors) "
                                   "but rank 0 sent 'done': the ranks' tensor streams differ")
            return sent
        keep = None
        try:
            if failure is not None:
                raise failure
            if bucket is None:
                raise RuntimeError("this rank's tensor stream ended before rank 0's: the ranks' tensor streams differ")
            if header[1] != bucket.names:
                raise ValueError(f"bucket {sent}: rank 0 sends {len(header[1])} tensors, this rank made "
                                 f"{len(bucket.names)}; the ranks' tensor streams differ")
            keep = stage_bucket([(t.name, t.tensor) for t in bucket.tensors], flatten)
            own = serialize_bucket(keep, flatten, 1)[0]
        except Exception as e:  # handed to rank 0 through the gather, which fails the bucket on every rank
            own = RankFailure(channel.rank, repr(e))
        channel._gather(own)
        error = channel._broadcast(None)
        del keep  # the engines have replied: their copies out of this rank's memory are done
        if error is not None:
            raise RuntimeError(f"trainer rank {channel.rank}: weight sync bucket {sent} failed: {error}") from failure
        sent += 1


def _next_bucket(buckets) -> tuple[Bucket | None, Exception | None]:
    """The next bucket (None at the end of the stream), or the exception that making it raised."""
    try:
        return next(buckets, None), None
    except Exception as e:
        return None, e


def _raise_if_aborted(message) -> None:
    if message[0] == "abort":
        raise RuntimeError(f"weight sync aborted by the trainer's rank 0: {message[1]}")
