"""One pinned host copy of the weights' one allocation, shared by the memory release and the rollback mirror.

With the memory saver the engine's weights live in one allocation (memory_saver.copy_into_one_allocation). A
release copies it to the host and a resume copies it back (managers/memory_occupation.py); the weight sessions'
rollback mirror (engine/weights/mirror.py) keeps a host copy of every served tensor between syncs. Between syncs the
two hold the same bytes, so they share this copy (one model's size of pinned memory, not two): the mirror's buffers
are views into it, and it knows which byte ranges may differ from the device (`stale`): a load marks what it wrote,
a mirror copy clears what it copied. A release copies only the stale ranges (none once the mirror's background copy
after a sync is done), and the first session after a release finds every rollback value on the host.

A release inside an open weight-update session must not overwrite that session's rollback values in the mirror's
views: it copies the whole allocation into a buffer of its own for the resume.

A resume copies nothing back at once: in slime's order (the weights resumed, the sync, then the KV cache and graphs)
the sync overwrites most of it. The ranges the device does not hold yet are `pending`; a load removes what it
writes, and `complete` copies the rest back before anything reads the values: the engine's last resume (it generates
only with nothing released), a checksum, `get_weights_by_name`, a copy to the mirror.
"""

from __future__ import annotations

import bisect
from typing import Callable

import torch


class ByteRanges:
    """Disjoint half-open byte ranges [start, end), kept sorted and merged."""

    def __init__(self, ranges: list[tuple[int, int]] = ()):
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in ranges:
            self.add(start, end)

    def __iter__(self):
        return iter(zip(self._starts, self._ends))

    def __bool__(self) -> bool:
        return bool(self._starts)

    @property
    def nbytes(self) -> int:
        return sum(e - s for s, e in self)

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        i = bisect.bisect_left(self._ends, start)  # the first range ending at or after `start`: it may touch
        j = bisect.bisect_right(self._starts, end)  # ranges i..j-1 touch [start, end)
        if i < j:
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j], self._ends[i:j] = [start], [end]

    def remove(self, start: int, end: int) -> None:
        if end <= start:
            return
        i = bisect.bisect_right(self._ends, start)  # ranges ending at or before `start` stay
        j = bisect.bisect_left(self._starts, end)   # ranges starting at or after `end` stay
        keep_s, keep_e = [], []
        if i < j and self._starts[i] < start:
            keep_s.append(self._starts[i]), keep_e.append(start)
        if i < j and self._ends[j - 1] > end:
            keep_s.append(end), keep_e.append(self._ends[j - 1])
        self._starts[i:j], self._ends[i:j] = keep_s, keep_e

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._ends, start)
        return i < len(self._starts) and self._starts[i] < end

    def clear(self) -> None:
        self._starts, self._ends = [], []


class PinnedWeightCopy:
    """The host copy of `block` (the weights' one allocation, uint8), pinned on a CUDA device, allocated at first use.

    `stale`: the ranges where the host may differ from the device; all of it until the first copy."""

    def __init__(self, block: torch.Tensor):
        self.block = block
        self.host: torch.Tensor | None = None
        self.stale = ByteRanges([(0, block.numel())])
        self.pending = ByteRanges()  # the ranges the device does not hold since a resume; the host holds them
        self.settle: Callable[[], None] = lambda: None  # the mirror's wait: its copies in flight land in `host`
        self._side: torch.Tensor | None = None  # a release's own copy while a session holds rollback values here
        self.saved_bytes = 0  # what the last save copied

    def _host(self) -> torch.Tensor:
        if self.host is None:
            self.host = torch.empty_like(self.block, device="cpu", pin_memory=self.block.is_cuda)
        return self.host

    def span(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """The byte range of `tensor` inside the block, or None where it lies elsewhere."""
        if tensor.numel() == 0 or tensor.device != self.block.device:
            return None
        start = tensor.data_ptr() - self.block.data_ptr()
        last = sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride()))
        end = start + (last + 1) * tensor.element_size()
        return (start, end) if 0 <= start and end <= self.block.numel() else None

    def view_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The host bytes of a contiguous `tensor` of the block, as its dtype and shape; None for any other."""
        span = self.span(tensor)
        if span is None or not tensor.is_contiguous():
            return None
        return self._host()[span[0]:span[1]].view(tensor.dtype).view(tensor.shape)

    def holds(self, buf: torch.Tensor | None) -> bool:
        """Whether `buf` is a view into the host copy."""
        return (buf is not None and self.host is not None
                and 0 <= buf.data_ptr() - self.host.data_ptr() < self.host.numel())

    def is_view_of(self, buf: torch.Tensor | None, tensor: torch.Tensor) -> bool:
        """Whether `buf` is `view_of(tensor)` (without making that view again)."""
        span = self.span(tensor) if self.holds(buf) and tensor.is_contiguous() else None
        return (span is not None and buf.data_ptr() - self.host.data_ptr() == span[0]
                and buf.dtype == tensor.dtype and buf.shape == tensor.shape)

    def current(self, tensor: torch.Tensor) -> bool:
        """Whether the host holds `tensor`'s served value (no load since it was last copied)."""
        span = self.span(tensor)
        return span is not None and self.host is not None and not self.stale.overlaps(*span)

    def load(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write `value` into `param` (a served tensor) and keep the account: what a contiguous write covers is no
        longer pending; a strided one first gets the bytes between its elements back."""
        span = self.span(param)
        contiguous = param.is_contiguous()
        if span is not None and not contiguous:
            self.complete(param)
        param.copy_(value)
        if span is not None:
            self.stale.add(*span)
            if contiguous:
                self.pending.remove(*span)

    def complete(self, tensor: torch.Tensor | None = None) -> int:
        """Copy back to the device what a resume deferred (of `tensor` only, where given), before it is read; returns
        the bytes copied (queued on the current stream)."""
        span = (0, self.block.numel()) if tensor is None else self.span(tensor)
        if span is None or not self.pending.overlaps(*span):
            return 0
        copied = 0
        for start, end in list(self.pending):
            start, end = max(start, span[0]), min(end, span[1])
            if start < end:
                self.block[start:end].copy_(self._host()[start:end], non_blocking=True)
                self.pending.remove(start, end)
                copied += end - start
        return copied

    def copied(self, tensor: torch.Tensor) -> None:
        """The device's `tensor` was copied into `view_of(tensor)`, and nothing has written it since."""
        span = self.span(tensor)
        if span is not None:
            self.stale.remove(*span)

    def save(self, session_open: bool) -> None:
        """Before a release: the host holds the whole block afterwards (queued on the current stream; the caller
        synchronizes). With a session open its rollback values stay where they are and the block goes to a buffer
        of its own."""
        self.settle()
        if session_open:
            self._side = torch.empty_like(self.block, device="cpu", pin_memory=self.block.is_cuda)
            self._side.copy_(self.block, non_blocking=True)
            self.saved_bytes = self.block.numel()
            return
        host, self.saved_bytes = self._host(), self.stale.nbytes
        for start, end in self.stale:
            host[start:end].copy_(self.block[start:end], non_blocking=True)
        self.stale.clear()

    def restore(self) -> None:
        """After a resume: the block as `save` left it, copied back from a release's own buffer at once, or from the
        shared copy as it is read or written (`pending`, `complete`)."""
        if self._side is not None:
            self.block.copy_(self._side, non_blocking=True)
            self._side = None
            return
        self.pending = ByteRanges([(0, self.block.numel())])
