"""Receiving a weight update on the engine: straight into the served parameters, restorable, timed.

Inside a session, a distributed update is broadcast into the parameter itself when its name, shape,
dtype and device match what is served: no fresh buffer, no second copy. Before the first byte of a
tensor lands, the session's rollback snapshot of it is taken, so a session that fails mid-broadcast
still restores every tensor it touched. A tensor whose dtype or device differs is received into a
buffer and copied (converted) afterwards; one no runner serves (a tied `lm_head.weight`) into a scratch
buffer that is dropped. The broadcast always completes on every rank, whatever this engine does with it.

The snapshot is the session's (engine/weights/session.py), held in the engine's host mirror
(engine/weights/mirror.py): no device memory, and in the steady state no copy on the sync's path.

On CUDA every write is asynchronous; `settle` waits for them, so a reply is sent only after the weights
have landed (a CUDA-IPC sender may free or reuse its bucket the moment it reads the reply).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Callable

import torch

from slime_spec.common.threads import intra_op_threads


@dataclass
class EngineTiming:
    """Seconds this engine spent on one update request: receiving bytes and loading them (validation,
    snapshot, copies, device sync). Sent back as `slime_spec_engine_timing`, a slime-spec extension."""

    receive_s: float = 0.0
    load_s: float = 0.0
    snapshot_s: float = 0.0  # inside load_s: holding the session's rollback values, which SGLang does not do (on
    # CUDA the in-place distributed receive counts queueing the copies only; their device time lands in receive_s)
    direct: int = 0  # tensors received straight into parameter memory
    buffered: int = 0  # tensors received into a buffer and copied
    snapshot_copied_bytes: int = 0  # rollback values copied to the host on this update's path (counted by the
    snapshot_mirrored_bytes: int = 0  # update's session.UpdateSnapshot alone) and those the mirror already held

    def fields(self) -> dict:
        return {"receive_s": self.receive_s, "load_s": self.load_s, "snapshot_s": self.snapshot_s,
                "direct_tensors": self.direct, "buffered_tensors": self.buffered,
                "snapshot_copied_bytes": self.snapshot_copied_bytes,
                "snapshot_mirrored_bytes": self.snapshot_mirrored_bytes}

    def tagged(self, message: str) -> str:
        """`message` with this timing appended after TIMING_TAG: SGLang's reply structs carry only success and
        message, so the timing rides in the message (weight_sync's engine_timing reads it back)."""
        return f"{message} {TIMING_TAG}{json.dumps(self.fields(), separators=(',', ':'))}"


TIMING_TAG = "slime_spec_engine_timing="


@contextlib.contextmanager
def copy_threads(device: str | torch.device):
    """On a CPU engine, copy on one intra-op thread: a copy is memory-bound, and OpenMP workers that
    spin-wait for a core the gloo receiver or the trainer holds turn a 10 ms snapshot into a second
    (measured on 2 shared cores: 0.02 s on one thread, 0.8-2.9 s on two)."""
    with intra_op_threads(1 if torch.device(device).type == "cpu" else None):
        yield


def settle(device: str | torch.device) -> None:
    """Wait until every queued copy on `device` has completed (a no-op on CPU, where copies are synchronous)."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(device)


class DeviceSpan:
    """Seconds of the work queued between construction and `stop()`: on CUDA the device's own time (CUDA events,
    read once that work has completed, e.g. after `settle`), so timing a phase adds no device sync; on CPU wall time."""

    def __init__(self, device: str | torch.device):
        self.cuda = str(device).startswith("cuda") and torch.cuda.is_available()
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        self._t0, self._t1 = time.perf_counter(), None

    def stop(self) -> None:
        if self.cuda:
            self._end.record()
        self._t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            return self._start.elapsed_time(self._end) / 1000.0
        return self._t1 - self._t0


def same_device(a: torch.device, b: str | torch.device) -> bool:
    """`cuda` and `cuda:<current>` are one device; `cpu` is `cpu`."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    return (a.index if a.index is not None else torch.cuda.current_device()) == \
        (b.index if b.index is not None else torch.cuda.current_device())


def receive_in_place(group, specs: list[tuple[str, torch.dtype, list[int]]], recv_device: str,
                     plan: list[tuple[torch.nn.Parameter, torch.Tensor]], metas: list[torch.Tensor],
                     snapshot: Callable[[str], None], timing: EngineTiming) -> None:
    """Receive each broadcast tensor, in order, into its parameter(s); `plan` pairs parameters with `metas`.

    `snapshot(name)` runs before the first write of `name` (the session's rollback copy).
    """
    targets: dict[int, list[torch.nn.Parameter]] = {}
    for param, meta in plan:
        targets.setdefault(id(meta), []).append(param)
    with torch.no_grad():
        for (name, dtype, shape), meta in zip(specs, metas):
            params = targets.get(id(meta), [])
            t0 = time.perf_counter()
            if params:
                snapshot(name)
            timing.snapshot_s += time.perf_counter() - t0
            first = params[0].data if params else None
            direct = (first is not None and first.dtype == dtype and same_device(first.device, recv_device)
                      and first.is_contiguous())
            buf = first if direct else torch.empty(shape, dtype=dtype, device=recv_device)
            t1 = time.perf_counter()
            group.broadcast(buf, src=0)
            t2 = time.perf_counter()
            for param in params[1:] if direct else params:
                param.data.copy_(buf.to(device=param.device, dtype=param.dtype))
            timing.direct += bool(direct)
            timing.buffered += bool(params) and not direct
            timing.receive_s += t2 - t1
            timing.load_s += (t1 - t0) + (time.perf_counter() - t2)
