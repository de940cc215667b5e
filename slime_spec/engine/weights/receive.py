"""Receiving a weight update on the engine: straight into the served parameters, restorable, timed.

Inside a session, a distributed update is broadcast into the parameter itself when its name, shape,
dtype and device match what is served: no fresh buffer, no second copy. Before the first byte of a
tensor lands, the session's rollback snapshot of it is taken, so a session that fails mid-broadcast
still restores every tensor it touched. A tensor whose dtype or device differs is received into a
buffer and copied (converted) afterwards; one no runner serves (a tied `lm_head.weight`) into a scratch
buffer that is dropped. The broadcast always completes on every rank, whatever this engine does with it.

Snapshots live in a `SnapshotStore`, in two tiers. On a CUDA engine a tensor is first copied to a buffer on its
own device, while the session's device budget lasts (`device_snapshot_budget`: what the device has free, less
`DEVICE_SNAPSHOT_HEADROOM_BYTES`): a device-to-device copy runs at memory bandwidth (~2-3 TB/s on an H100)
against the ~25-50 GB/s of a pinned device-to-host copy, which dominated a colocated sync (0.16 s of 0.24 s at
5.7 GB). Device buffers live for one session: `end_session` drops them and hands the memory back to the driver,
so a trainer sharing the GPU gets it back. What does not fit goes to the host tier: one host buffer per served
tensor, allocated at the first session and reused by every later one (pinned for a CUDA engine, so the copy runs
at bus speed); allocating fresh host memory for every sync costs a page fault per 4 KiB page, more than the copy
itself. The price of the host tier is up to one model's size in host memory for the engine's lifetime. A CPU
engine has no device tier (its budget is 0): the reused host buffers are the cheaper copy there.

On CUDA every write is asynchronous; `settle` waits for them, so a reply is sent only after the weights
have landed (a CUDA-IPC sender may free or reuse its bucket the moment it reads the reply).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from slime_spec.common.threads import intra_op_threads


@dataclass
class EngineTiming:
    """Seconds this engine spent on one update request: receiving bytes and loading them (validation,
    snapshot, copies, device sync). Sent back as `slime_spec_engine_timing`, a slime-spec extension field."""

    receive_s: float = 0.0
    load_s: float = 0.0
    snapshot_s: float = 0.0  # inside load_s: the session's rollback copies, which SGLang does not make (on CUDA
    # the in-place distributed receive counts queueing them only; their device time lands in receive_s)
    direct: int = 0  # tensors received straight into parameter memory
    buffered: int = 0  # tensors received into a buffer and copied
    snapshot_device_bytes: int = 0  # this update's rollback copies kept on the device (counted by the
    snapshot_host_bytes: int = 0  # update's weight_session.UpdateSnapshot alone) and those copied to host buffers

    def reply_field(self) -> dict:
        return {"slime_spec_engine_timing": {"receive_s": self.receive_s, "load_s": self.load_s,
                                             "snapshot_s": self.snapshot_s, "direct_tensors": self.direct,
                                             "buffered_tensors": self.buffered,
                                             "snapshot_device_bytes": self.snapshot_device_bytes,
                                             "snapshot_host_bytes": self.snapshot_host_bytes}}


DEVICE_SNAPSHOT_HEADROOM_BYTES = 2 << 30  # left free on the device: the update's own receive buffers (a flattened
# bucket of --update-weight-buffer-size, 512 MiB by default, or a dtype conversion) and other allocations must fit


def device_snapshot_budget(device: str | torch.device, headroom: int = DEVICE_SNAPSHOT_HEADROOM_BYTES) -> int:
    """Bytes of rollback snapshot a session may keep on `device`: free device memory (the driver's, plus what
    torch's allocator holds unused) less `headroom`; 0 on a CPU engine, whose snapshots go to reused host buffers."""
    if not (str(device).startswith("cuda") and torch.cuda.is_available()):
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(0, free + cached - headroom)


@dataclass
class SnapshotStore:
    """Rollback copies of served tensors: on their own device within the session's budget, else in host buffers
    (one reusable buffer per (role, name)). `begin_session(budget)` opens a session, `end_session()` drops its
    device copies. It keeps the budget, not a count of bytes: the update that asks for a copy counts it
    (weight_session.UpdateSnapshot), once."""

    buffers: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)  # host tier, kept across sessions
    device_budget: int = 0  # bytes the open session may still take on the device
    _device_copies: list[torch.Tensor] = field(default_factory=list)

    def begin_session(self, device_budget: int) -> None:
        self.end_session()
        self.device_budget = max(0, int(device_budget))

    def end_session(self) -> None:
        """Drop the session's device copies; on CUDA hand their memory back to the driver, since a colocated
        trainer on the same GPU needs it once the sync is over. Idempotent."""
        cuda = any(t.is_cuda for t in self._device_copies)
        self._device_copies.clear()
        self.device_budget = 0
        if cuda:
            torch.cuda.empty_cache()

    @property
    def device_bytes_held(self) -> int:
        """Device memory the open session's copies hold (what end_session hands back)."""
        return sum(t.numel() * t.element_size() for t in self._device_copies)

    @property
    def host_bytes_held(self) -> int:
        """Host memory of the host tier (kept for the engine's life)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def copy_of(self, role: str, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A copy of `tensor`, and whether it went to the device tier."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= self.device_budget:
            try:
                buf = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            except torch.OutOfMemoryError:  # the budget was measured at begin; a colocated trainer took memory since
                self.device_budget = 0
            else:
                buf.copy_(tensor.detach())
                self._device_copies.append(buf)
                self.device_budget -= nbytes
                return buf, True
        buf = self.buffers.get((role, name))
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            pin = tensor.is_cuda and torch.cuda.is_available()
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self.buffers[(role, name)] = buf
        buf.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        return buf, False


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
