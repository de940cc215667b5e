"""A host copy of the served weights, kept equal to them between weight-update sessions: the rollback snapshot.

A session that fails part way must restore every tensor it wrote (engine/weights/session.py), so the value of
each tensor from before `begin` has to exist somewhere other than the parameter. Keeping it on the device costs a
second model's worth of device memory, which in a colocated run belongs to the trainer; copying it to the host
inside the sync puts a PCIe copy of the whole model on the sync's critical path. The mirror does neither: after a
session ends, the tensors it wrote are copied to the host in the background (a side stream on CUDA, a thread on
CPU) while the engine generates, so by the next `begin` the host already holds what is served and the sync copies
nothing. A tensor the mirror does not hold fresh (the first sync of the engine's life, a tensor written outside a
session) is copied just before its first write, as before.

Freshness is kept per (role, name), which survives a memory release and resume (the values come back the same,
at new addresses); a tensor several runners serve (MiMo's embedding in the target and the MTP runner) shares one
host buffer. Cost: one model's size of host memory (pinned on a CUDA engine, so the copies run at bus speed) for
the engine's life, and one device-to-host copy of each written tensor per sync, off the critical path. With the
memory saver that host memory is the memory release's own copy of the weights (model_executor/pinned_weights.py):
the buffers are views into it, and every copy into one tells it which bytes are now current.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable

import torch

from slime_spec.engine.model_executor.pinned_weights import PinnedWeightCopy

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (role, HF name)


def storage_key(tensor: torch.Tensor) -> tuple:
    """One key for one served tensor, however many runners serve it (MiMo's MTP runner shares the embedding)."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype


class HostMirror:
    """Host buffers per (role, name) and which of them equal what is served (`fresh`)."""

    def __init__(self, host: PinnedWeightCopy | None = None):
        """host: the release's copy of the weights, whose views serve as the buffers of the tensors it holds."""
        self.buffers: dict[Key, torch.Tensor] = {}
        self.fresh: set[Key] = set()
        self.host = host
        self._pending: _Refresh | None = None
        if host is not None:
            host.settle = self.wait  # a release reads the host only after the copies in flight

    @property
    def host_bytes_held(self) -> int:
        return sum(b.numel() * b.element_size() for b in {id(b): b for b in self.buffers.values()}.values())

    def backup_of(self, key: Key, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The host copy of `tensor`'s value now, and whether it had to be copied (False: the mirror held it)."""
        self.wait()
        buf, shared = self._buffer_for(key, tensor)
        if key in self.fresh or (shared and self.host.current(tensor)):
            self.fresh.add(key)
            return buf, False
        if self.host is not None:
            self.host.complete(tensor)  # its value on the device, where a resume deferred it
        buf.copy_(tensor.detach(), non_blocking=tensor.is_cuda)  # stream-ordered before the write that follows
        if shared:
            self.host.copied(tensor)
        self.fresh.add(key)  # rollback restores this value; a successful session marks it stale at its end
        return buf, True

    def _buffer_for(self, key: Key, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """`key`'s buffer for `tensor`, and whether it is the host copy's view of it (where there is one; else a
        buffer of its own). A buffer of another place, shape or dtype is replaced, and its entry is not fresh."""
        buf = self.buffers.get(key)
        if self.host is not None and self.host.is_view_of(buf, tensor):
            return buf, True
        view = self.host.view_of(tensor) if self.host is not None else None
        if view is not None:
            buf = view
        elif not _fits(buf, tensor) or (self.host is not None and self.host.holds(buf)):  # a view of other bytes
            buf = _host_buffer(tensor)
        if buf is not self.buffers.get(key):
            self.buffers[key] = buf
            self.fresh.discard(key)
        return buf, view is not None

    def invalidate(self) -> None:
        """Served weights changed outside a session: nothing in the mirror can be trusted."""
        self.wait()
        self.fresh.clear()

    def refresh(self, served: Iterable[tuple[Key, torch.Tensor]]) -> None:
        """Mark `served` stale and copy each into its host buffer in the background; `wait` (every next `backup_of`,
        `invalidate` and `refresh` does) blocks until those copies are done, and only then are they fresh. Entries of
        one storage share one buffer and one copy."""
        self.wait()
        groups: dict[tuple, list[Key]] = {}
        tensors: dict[tuple, torch.Tensor] = {}
        for key, tensor in served:
            self.fresh.discard(key)
            skey = storage_key(tensor)
            groups.setdefault(skey, []).append(key)
            tensors[skey] = tensor.detach()
        copies = []
        for skey, keys in groups.items():
            tensor = tensors[skey]
            if self.host is not None:
                self.host.complete(tensor)  # written by the session: nothing pending, unless strided
            buf = self.host.view_of(tensor) if self.host is not None else None
            shared = buf is not None
            if buf is None:
                buf = next((self.buffers[k] for k in keys if _fits(self.buffers.get(k), tensor)), None)
            if buf is None:
                buf = _host_buffer(tensor)
            for k in keys:
                self.buffers[k] = buf
            copies.append((buf, tensor, keys, shared))
        if copies:
            self._pending = _Refresh(copies)

    def wait(self) -> None:
        """Block until the background copies are done; then their entries are fresh."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.wait():
            for _, tensor, keys, shared in pending.copies:
                self.fresh.update(keys)
                if shared:
                    self.host.copied(tensor)


class _Refresh:
    """Device-to-host copies in flight: on a side stream (CUDA), or on a thread (CPU: the copy releases the GIL, so
    the engine thread generates meanwhile)."""

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor, list[Key], bool]]):
        self.copies, self.error = copies, None
        self.cuda = copies[0][1].is_cuda
        if self.cuda:
            device = copies[0][1].device
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # after the session's writes
            with torch.cuda.stream(stream):
                for buf, tensor, _, _ in copies:
                    buf.copy_(tensor, non_blocking=True)
                    tensor.record_stream(stream)  # a memory release meanwhile must not hand the block to another
                self.done = torch.cuda.Event()
                self.done.record(stream)
        else:
            self.thread = threading.Thread(target=self._copy, name="weight-mirror", daemon=True)
            self.thread.start()

    def _copy(self) -> None:
        try:
            with torch.no_grad():
                for buf, tensor, _, _ in self.copies:
                    buf.copy_(tensor)
        except Exception as e:  # the entries stay stale: the next session copies them on its own path
            self.error = e
            logger.exception("refreshing the host copy of the served weights failed")

    def wait(self) -> bool:
        """Whether every copy completed."""
        if self.cuda:
            self.done.synchronize()
            return True
        self.thread.join()
        return self.error is None


def _fits(buf: torch.Tensor | None, tensor: torch.Tensor) -> bool:
    return buf is not None and buf.shape == tensor.shape and buf.dtype == tensor.dtype


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    pin = tensor.is_cuda and torch.cuda.is_available()
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
