"""A chain verify's acceptance captured whole: lm_head, the sampling kernel's pass, the lossless rule, the accepted
tokens and the packed read-back in one CUDA graph per (batch size, width).

The target's verify forward is a graph already; the acceptance after it launched about 50 small eager ops (the
lm_head, the kernel's seed, the uniforms, the cumulative product, gathers, the logprobs, the `chosen` scatter and the
read-back's packing), each costing the host more than the device. Here it is one replay: a NEXTN step 1.08-1.10x
faster at batch 1-8 on an H200, the same at 128, where those launches hid behind the verify's device time
(docs/en/benchmarks/loop-h200-2026-11.md). It serves the batches the sampling kernel serves (every row sampled at its
temperature alone, deterministic drafts: `accept.accept_unfiltered`), RL's rollouts.

The randomness stays the engine's generator's: it is registered with every graph, so each replay draws fresh
Philox offsets from it, in the order eager acceptance would.
"""

from __future__ import annotations

import time
from bisect import bisect_left

import torch

from slime_spec.engine.model_executor import memory_saver
from slime_spec.engine.model_executor.cuda_graph import capture_stream
from slime_spec.engine.speculative.accept import accept_unfiltered


def chain_acceptance(model, generator: torch.Generator, hidden: torch.Tensor, drafts: torch.Tensor,
                     temperatures: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [n, k + 1, H] of a chain verify, drafts [n, k], temperatures [n] > 0 -> (accepted drafts [n], chosen
    [n, k + 1]: the accepted drafts then the token after them, packed [n, 2 + 2 (k + 1)] float64: accepted count,
    non-finite flag, chosen, logprobs of chosen), the columns `SpecWorker.commit` reads."""
    n, k1, _ = hidden.shape
    logits = model.logits(hidden.flatten(0, 1), upcast=False).view(n, k1, -1)
    accept, next_token, logprobs, broken = accept_unfiltered(logits, drafts, temperatures, generator)
    chosen = torch.cat((drafts, drafts.new_zeros(n, 1)), dim=1).scatter_(1, accept[:, None], next_token[:, None])
    packed = torch.cat((accept[:, None].double(), broken[:, None].double(), chosen.double(), logprobs.double()), 1)
    return accept, chosen, packed


class AcceptGraph:
    """`chain_acceptance` captured per (batch size, k + 1) on CUDA, padded up to the next captured batch size; its
    outputs are the graph's buffers, which the next replay overwrites: the caller's uses (the drafter's extend, the
    read-back's copy) are queued on the stream before it, so they read this step's values."""

    def __init__(self, model, generator: torch.Generator, *, batch_sizes: list[int], widths: list[int],
                 device: torch.device):
        self.model, self.generator = model, generator
        self.batch_sizes, self.widths = sorted(set(batch_sizes)), sorted(set(widths))
        self.device = torch.device(device)
        bs, w = self.batch_sizes[-1], self.widths[-1]
        weight = model.lm_head.weight
        self.hidden = torch.zeros(bs, w, weight.shape[1], dtype=weight.dtype, device=self.device)
        self.drafts = torch.zeros(bs, w - 1, dtype=torch.long, device=self.device)
        self.temperatures = torch.ones(bs, dtype=torch.float32, device=self.device)  # padded rows: 1, never 0
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.capture_seconds = 0.0
        self.calls = 0  # replays, so tests and benches see which path ran

    def serves(self, n: int, width: int) -> bool:
        return width in self.widths and n <= self.batch_sizes[-1]

    def _static_call(self, bs: int, w: int) -> tuple[torch.Tensor, ...]:
        return chain_acceptance(self.model, self.generator, self.hidden[:bs, :w], self.drafts[:bs, : w - 1],
                                self.temperatures[:bs])

    def capture(self) -> float:
        """Capture every shape, largest batch first; returns seconds. The warm-up runs compile the sampling kernel
        and advance the generator, as any sampled step would."""
        t0 = time.perf_counter()
        # A pool of its own, not the model graphs' (capture_on_one_pool): its outputs are read after the drafter's
        # graphs replay (the accepted counts by the next chain's lengths), so no other graph may reuse their memory.
        pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            for bs in reversed(self.batch_sizes):
                for w in self.widths:
                    for _ in range(2):
                        self._static_call(bs, w)
                    graph = torch.cuda.CUDAGraph()
                    graph.register_generator_state(self.generator)
                    with memory_saver.graph_capture(graph, pool, stream):
                        out = self._static_call(bs, w)
                    self.graphs[(bs, w)] = (graph, out)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    def __call__(self, hidden: torch.Tensor, drafts: torch.Tensor, temperatures: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """chain_acceptance's (accept [n], chosen [n, k + 1], packed [n, 2 + 2 (k + 1)]) for the n rows given."""
        n, w = hidden.shape[:2]
        bs = self.batch_sizes[bisect_left(self.batch_sizes, n)]
        if not self.graphs:
            self.capture()
        self.calls += 1
        self.hidden[:n, :w].copy_(hidden)
        self.drafts[:n, : w - 1].copy_(drafts)
        self.temperatures[:n].copy_(temperatures)
        graph, (accept, chosen, packed) = self.graphs[(bs, w)]
        graph.replay()
        return accept[:n], chosen[:n], packed[:n]
