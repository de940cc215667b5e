"""CUDA graphs for the embedded engine's decode, verify and draft forwards.

On a GPU a decode step of a small model is bound by kernel launches, not by the GPU: hundreds of small
kernels per token, each launched from Python. Capturing the forward once per shape and replaying it
removes that cost (gpt-fast's and SGLang's cure). A graph replays fixed shapes, so:

- the batch is padded up to the next captured batch size, SGLang's decode list
  (`--cuda-graph-bs-decode`, `--cuda-graph-max-bs-decode`; `decode_batch_sizes` reproduces SGLang's
  `generate_decode_cuda_graph_batch_sizes`); padded rows write into a scratch KV slot no request owns;
- attention reads a fixed number of keys, the next bucket above the longest row (`key_buckets`), so one
  graph serves every sequence length in its bucket;
- tokens per row are fixed per graph: 1 for decode and draft steps, k+1 for verify and draft extend (a tree's
  graphs, engine/speculative/tree_graphs.py: num_draft_tokens for its verify, topk for its draft steps).

Weights and the KV cache are read from their tensors' storage: weight updates copy into parameters in
place, so a sync needs no re-capture; releasing memory (which frees that storage) drops the graphs, and
they are captured again on the next forward. Which forwards of a model are captured is
engine/model_executor/model_graphs.py's.
"""

from __future__ import annotations

import gc
import time
from bisect import bisect_left
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch

from slime_spec.engine.model_executor import memory_saver


@dataclass(frozen=True)
class CudaGraphSettings:
    """SGLang's graph flags, as the embedded engine honours them (CUDA only; the CPU path runs eagerly)."""

    disable: bool = False                      # --disable-cuda-graph
    batch_sizes: tuple[int, ...] | None = None  # --cuda-graph-bs-decode (None: SGLang's default list)
    max_bs: int | None = None                  # --cuda-graph-max-bs-decode (None: --max-running-requests)
    disable_padding: bool = False              # --disable-cuda-graph-padding: capture every size up to max_bs
    torch_compile: bool = False                # --enable-torch-compile: fuse kernels before capture
    torch_compile_max_bs: int = 32             # --torch-compile-max-bs
    enable_cudagraph_gc: bool = False          # --enable-cudagraph-gc: let the garbage collector run during capture

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> "CudaGraphSettings":
        bs = values.get("cuda_graph_bs_decode")
        return cls(disable=bool(values.get("disable_cuda_graph")), batch_sizes=tuple(bs) if bs else None,
                   max_bs=values.get("cuda_graph_max_bs_decode"),
                   disable_padding=bool(values.get("disable_cuda_graph_padding")),
                   torch_compile=bool(values.get("enable_torch_compile")),
                   torch_compile_max_bs=int(values.get("torch_compile_max_bs") or 32),
                   enable_cudagraph_gc=bool(values.get("enable_cudagraph_gc")))

    def capture_sizes(self, max_running_requests: int, speculative: bool) -> list[int]:
        """The batch sizes to capture, clamped to the running-request limit as SGLang clamps to its pool."""
        max_bs = min(self.max_bs or max_running_requests, max_running_requests)
        sizes = list(self.batch_sizes) if self.batch_sizes else decode_batch_sizes(max_bs, speculative,
                                                                                   self.disable_padding)
        if max(sizes) > max_running_requests:
            sizes.append(max_running_requests)
        return sorted({s for s in sizes if 0 < s <= max_running_requests})


def decode_batch_sizes(max_bs: int, speculative: bool, disable_padding: bool = False) -> list[int]:
    """SGLang 0.5.23's default decode capture list for `max_bs` (finer steps for speculative decoding)."""
    if disable_padding:
        sizes = list(range(1, max_bs + 1))
    elif not speculative:
        sizes = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
                 + list(range(512, max_bs + 1, 32)))
    else:
        sizes = (list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4)) + list(range(72, 257, 8))
                 + list(range(272, max_bs + 1, 16)))
    sizes = [s for s in sizes if s <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


def key_buckets(max_keys: int, smallest: int = 256) -> list[int]:
    """Key counts a graph is captured for: powers of two from `smallest`, and `max_keys` itself."""
    out, n = [], smallest
    while n < max_keys:
        out.append(n)
        n *= 2
    return out + [max_keys]


def _bucket(sizes: list[int], n: int) -> int | None:
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


ForwardFn = Callable[..., torch.Tensor]  # (input_ids, positions, slots, num_keys, **extra) -> [B, T, H]
InputSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (trailing shape, dtype)


class GraphedForward:
    """One forward captured over (batch size, tokens per row, key count) shapes, replayed with padding.

    `fn(input_ids [B, T], positions [B, T], slots [B], num_keys, **extra)` must run only tensor ops on its
    inputs and return a [B, T, ...] tensor; `extra` names further per-token inputs [B, T, ...] (the MTP layer's
    hidden states, a tree's visible region) and `row_extra` per-row ones [B, ...] (a tree's base), each as
    {name: (trailing shape, dtype)}. Padded rows keep the extra inputs the buffers last held. With
    `capture=False` (CPU) the same padding runs eagerly, so the shape logic is tested where no GPU is.
    """

    def __init__(self, fn: ForwardFn, *, batch_sizes: list[int], token_counts: list[int], key_counts: list[int],
                 scratch_slot: int, device: torch.device, extra: InputSpecs | None = None,
                 row_extra: InputSpecs | None = None, capture: bool | None = None, pool=None, cache: Any = None,
                 compiled_fn: ForwardFn | None = None, compile_max_bs: int = 0):
        self.fn, self.cache = fn, cache  # calls with another KV cache object run eagerly (see `serves`)
        self.compiled_fn, self.compile_max_bs = compiled_fn, compile_max_bs
        self.batch_sizes, self.token_counts = sorted(set(batch_sizes)), sorted(set(token_counts))
        self.key_counts = sorted(set(key_counts))
        self.scratch_slot, self.device = scratch_slot, torch.device(device)
        self.capture_graphs = self.device.type == "cuda" if capture is None else capture
        bs, t = self.batch_sizes[-1], self.token_counts[-1]
        self.input_ids = torch.zeros(bs, t, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(bs, t, dtype=torch.long, device=self.device)
        self.slots = torch.full((bs,), scratch_slot, dtype=torch.long, device=self.device)
        self.pad_positions = torch.arange(t, device=self.device).expand(bs, t)
        self.extra = {name: torch.zeros(bs, t, *shape, dtype=dtype, device=self.device)
                      for name, (shape, dtype) in (extra or {}).items()}
        self.row_extra = {name: torch.zeros(bs, *shape, dtype=dtype, device=self.device)
                          for name, (shape, dtype) in (row_extra or {}).items()}
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool
        self.capture_seconds = 0.0
        self.calls = 0  # forwards served (padded and replayed), so tests and benches see which path ran

    def shape_for(self, batch: int, tokens: int, num_keys: int) -> tuple[int, int, int] | None:
        """The captured (batch, tokens, keys) a call pads up to, or None when it does not fit any graph."""
        if tokens not in self.token_counts:
            return None
        bs, keys = _bucket(self.batch_sizes, batch), _bucket(self.key_counts, num_keys)
        return None if bs is None or keys is None else (bs, tokens, keys)

    def serves(self, cache: Any, input_ids: torch.Tensor, num_keys: int | None) -> bool:
        """Whether a call on `cache` with this shape replays a graph (else the caller runs eagerly)."""
        return (cache is self.cache and num_keys is not None
                and self.shape_for(input_ids.shape[0], input_ids.shape[1], num_keys) is not None)

    def _static_call(self, bs: int, t: int, keys: int) -> torch.Tensor:
        extra = {name: buf[:bs, :t] for name, buf in self.extra.items()}
        extra.update((name, buf[:bs]) for name, buf in self.row_extra.items())
        fn = self.compiled_fn if self.compiled_fn is not None and bs <= self.compile_max_bs else self.fn
        return fn(self.input_ids[:bs, :t], self.positions[:bs, :t], self.slots[:bs], keys, **extra)

    def capture(self) -> float:
        """Capture every shape, largest batch first so smaller graphs reuse its memory; returns seconds."""
        if not self.capture_graphs or self.graphs:
            return 0.0
        t0 = time.perf_counter()
        self.slots.fill_(self.scratch_slot)
        self.positions.zero_()
        self.input_ids.zero_()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            for bs in reversed(self.batch_sizes):
                for t in self.token_counts:
                    for keys in self.key_counts:
                        for _ in range(2):  # warm-up: cuBLAS handles and workspaces before capture
                            self._static_call(bs, t, keys)
                        graph = torch.cuda.CUDAGraph()
                        with memory_saver.graph_capture(graph, self.pool, stream):
                            out = self._static_call(bs, t, keys)
                        self.graphs[(bs, t, keys)] = (graph, out)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, num_keys: int,
                 **extra: torch.Tensor) -> torch.Tensor:
        """Run at the padded shape; `num_keys` (a host int: longest row's last position + 1) picks the bucket."""
        n, t = input_ids.shape
        shape = self.shape_for(n, t, num_keys)
        if shape is None:
            raise ValueError(f"no captured graph for batch {n}, {t} tokens per row, {num_keys} keys "
                             f"(batch sizes {self.batch_sizes}, tokens {self.token_counts}, keys {self.key_counts})")
        bs, t, keys = shape
        self.calls += 1
        self.input_ids[:n, :t].copy_(input_ids)
        self.positions[:n, :t].copy_(positions)
        self.slots[:n].copy_(slots)
        if bs > n:  # padded rows: the scratch slot, positions 0..t-1
            self.slots[n:bs].fill_(self.scratch_slot)
            self.positions[n:bs, :t].copy_(self.pad_positions[: bs - n, :t])
        for name, value in extra.items():
            if name in self.row_extra:
                self.row_extra[name][:n].copy_(value)
            else:
                self.extra[name][:n, :t].copy_(value)
        if not self.capture_graphs:
            with torch.no_grad():
                return self._static_call(bs, t, keys)[:n].clone()
        if not self.graphs:
            self.capture()
        graph, out = self.graphs[shape]
        graph.replay()
        return out[:n].clone()


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One capture stream per device, as SGLang keeps one: cuBLAS keeps a workspace per (handle, stream), and a
    captured matmul's workspace must outlive its graph, so every graph sharing one stream shares one workspace."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def capture_on_one_pool(graphs: list[GraphedForward], enable_cudagraph_gc: bool) -> float:
    """Capture `graphs` on one memory pool (their replays never overlap: each output is cloned before the next),
    the collector frozen (`freeze_gc`); returns the seconds."""
    pool, seconds = None, 0.0
    with freeze_gc(enable_cudagraph_gc):
        for g in graphs:
            g.pool = pool
            seconds += g.capture()
            pool = g.pool
    return seconds


@contextmanager
def freeze_gc(enable_cudagraph_gc: bool):
    """SGLang's capture guard: collect garbage first, then freeze what is left, so no collection during capture
    frees a dead engine's graphs, streams or pinned buffers: CUDA calls that invalidate a capture in progress
    (seen as CUBLAS_STATUS_EXECUTION_FAILED inside a captured matmul when a collection happened to run there)."""
    gc.collect()
    if enable_cudagraph_gc:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()
