"""SGLang's overlap schedule for the embedded engine's plain decode: launch step t + 1 before reading step t.

A decode step ends in a read-back: the host needs the new tokens to check stops and build the next step. On a GPU
the device idles through that host work (appending tokens, finish checks, the next step's inputs), about a quarter
of a batch-1 step of a 0.7B model. With the overlap schedule each row's last token stays on the device (a buffer
indexed by cache slot), so step t + 1 is launched from it first and step t's results are read back after, while
t + 1 runs. A row that finished at step t has also run step t + 1; that token is dropped, as SGLang's overlap
schedule drops it. It is on by default on CUDA (SGLang's default; `--disable-overlap-schedule` turns it off) for
plain decoding, and for the plain steps (k = 0) that adaptive or auto speculation chooses: a run of them overlaps like
plain decoding, and the drafter's bookkeeping of each (MTP's deferred extend) happens when the step is read back.
Speculative steps themselves are read back one by one. SGLang 0.5.23 overlaps them too (its EAGLE V2 worker under
this schedule); for this engine that was measured slower at batch 128, whose steps are bound by the host's launches
(docs/en/benchmarks/loop-h200-2026-11.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from slime_spec.engine.model_executor.transfer import device_tensor


@dataclass
class InFlight:
    """A launched decode step whose results are not yet read: `host` [2 or 3, n] (EngineCore.decode_forward's values)
    fills asynchronously; `event` marks when it is complete."""

    rows: list
    host: torch.Tensor
    event: torch.cuda.Event | None
    hidden: torch.Tensor      # what a drafter keeps of the step [n, 1, ...] (decode_forward's features)
    positions: list[int]      # each row's position the step read (its kv_len before the step)
    since: float              # perf_counter when its device time began: its launch, or the read-back of the step
                              # it was queued behind (what a speculative step's drain measures it from)


class OverlapDecode:
    def __init__(self, engine, on_appended: Callable[[InFlight, list[int]], None] | None = None):
        """on_appended(step, live): called after a step's tokens were appended, with the indices of the rows that
        received one (a speculative engine's per-step bookkeeping, SpecWorker.after_overlapped_step)."""
        self.engine = engine
        self.on_appended = on_appended
        self.last_token = torch.zeros(engine.max_running_requests + 1, dtype=torch.long, device=engine.device)
        self.in_flight: InFlight | None = None
        self.pinned = engine.device.type == "cuda"
        # Two sets of pinned host buffers, alternating by step: step t's are reused at step t + 2, after step t's
        # results were read (so its copies are complete). Allocating pinned memory per step would not overlap:
        # a block still in use by a queued copy cannot be recycled, and a fresh one costs a slow host allocation.
        rows = engine.max_running_requests
        self.inputs = [torch.zeros((rows, 2), dtype=torch.long, pin_memory=self.pinned) for _ in range(2)]
        self.outputs = [torch.zeros(3 * rows, dtype=torch.float64, pin_memory=self.pinned) for _ in range(2)]
        self.flip = 0
        self.wait_s = 0.0  # seconds the host waited for read-backs: what is left of a step once the host is hidden

    def after_prefill(self, rows: list) -> None:
        """Rows just prefilled have their first token on the host: put it where the next launch reads it."""
        if rows:
            pairs = device_tensor([[r.slot, r.tokens[-1]] for r in rows], self.engine.device)
            self.last_token[pairs[:, 0]] = pairs[:, 1]

    def step(self, rows: list) -> None:
        """Launch a decode step for `rows` (running, unfinished), then append the previous step's results."""
        previous = self.in_flight
        self.in_flight = self._launch(rows) if rows else None
        if previous is not None:
            self._append(previous)
            if self.in_flight is not None:
                self.in_flight.since = time.perf_counter()

    def drain(self) -> None:
        """Append the results of the step in flight (before memory is released or when the engine goes idle)."""
        previous, self.in_flight = self.in_flight, None
        if previous is not None:
            self._append(previous)

    def _launch(self, rows: list) -> InFlight:
        since = time.perf_counter()
        e = self.engine
        n, buffer = len(rows), self.flip
        self.flip ^= 1
        positions = [r.kv_len for r in rows]
        host_in = self.inputs[buffer]
        host_in[:n].copy_(torch.tensor([[p, r.slot] for p, r in zip(positions, rows)]))
        step = e.model.graphs.get("decode")  # the whole step captured (engine/model_executor/decode_graph.py)
        shape = step.shape_for(n, 1, max(positions) + 1) if step is not None else None
        if shape is not None:
            step.pad_rows(host_in, n, shape[0])
            hidden, logits, tokens, values = step.replay(host_in, n, shape)
            for row in rows:
                row.kv_len += 1
            if e.drafter is not None:  # kept until this step's read-back, after the next replay
                hidden = hidden.clone()
            if not e.plain_greedy(rows):  # sampled rows, logprobs: picked from the graph's logits
                tokens, logprobs = e._pick_on_device(rows, logits)
                self.last_token[step.slots[:n]] = tokens
                values = torch.stack([tokens.double(), values[1, :n]] + ([] if logprobs is None else
                                                                          [logprobs.double()]))
        else:
            host_in = host_in[:n]
            inputs = host_in.to(e.device, non_blocking=self.pinned) if self.pinned else host_in.clone()
            slots = inputs[:, 1]
            hidden, tokens, values = e.decode_forward(rows, self.last_token[slots][:, None], inputs[:, 0:1], slots)
            self.last_token[slots] = tokens
        host = self.outputs[buffer][: values.numel()].view(values.shape)  # contiguous: a strided target would
        host.copy_(values, non_blocking=self.pinned)                         # make the copy synchronous
        event = None
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
        return InFlight(rows, host[:, :n], event, hidden, positions, since)

    def _append(self, batch: InFlight) -> None:
        if batch.event is not None:
            t = time.perf_counter()
            batch.event.synchronize()
            self.wait_s += time.perf_counter() - t
        live = [i for i, r in enumerate(batch.rows) if r.finish is None]
        self.engine.append_decoded(batch.rows, batch.host.tolist())
        if self.on_appended is not None:
            self.on_appended(batch, live)
