"""Where a decode step's time goes on one GPU: wall time per step against the device's busy time, for plain decoding
and a speculative chain (NEXTN, the MTP layer drafting; adaptive, its plain steps), from torch's profiler.

    python bench/step_profile_gpu.py                   # the 0.7B shape of bench/engine_gpu.py, batch 1, k = 5
    python bench/step_profile_gpu.py --batch 8 --steps 3
    python bench/step_profile_gpu.py --engines plain --cprofile --top 25   # plain decoding's host work
    python bench/step_profile_gpu.py --model outputs/demo/model_sft --batch 128 --steps 3 --temperature 1 --logprobs
    python bench/step_profile_gpu.py --vocab 151936 --batch 128 --steps 3 --temperature 1 --logprobs --phases 3 \
        --without sampling --without activation   # the engine without a kernel, side by side with all of them
    python bench/step_profile_gpu.py --model /tmp/demo_shape --batch 128 --steps 3 --temperature 1 --logprobs \
        --phases 3 --engines spec --without accept_graph   # a chain's acceptance eager, beside its graph

The target is random (the MTP layer too), so drafts are rarely accepted: the point is each step's structure (k draft
steps, one verify of k + 1 tokens, its read-back and the host's bookkeeping), not its yield. Per engine it prints
wall ms per step, the sum of the kernels' durations per step (device busy), the difference (the device idle), and
the kernels that take the most device time. The idle time is split by the gaps between consecutive kernels: short
ones (under GAP_US, the device's own launch latency between kernels, inside a graph too) and long ones (the device
waiting for the host, whose work the profiler itself slows). With programmatic dependent launch (kernels.pdl) kernels
overlap, so the busy time can exceed the wall time. Plain decoding (and adaptive) also print, without the profiler,
each step's wall time (the first holds the prefill) and how long the host waited for each read-back: a host that
waits is hidden behind the device; plain decoding also times its captured step replayed alone, and checks its greedy
tokens against the same engine's eager forwards.

With --tail N request i decodes tokens - i * N // batch tokens, so the batch shrinks over its last N steps as a batch
decoded to EOS does; `--phases` then splits one decode's wall time by step kind (`StepPhases`: the prefill, steps by
draft length k, the steps below batch 64, the drafter's catch-up before drafting), without the profiler.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import itertools
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from slime_spec.engine.kernels import decode_attention
from slime_spec.engine.kernels.ops import Kernels
from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings
from slime_spec.speculative.settings import SpecConfig
from slime_spec.tools.tiny_model import make_tiny_model

# --without names that are not kernels: a captured graph set aside, and the attention kernel's per-row block grid
# for a verify (the engine built, its graphs captured, with the per-token grid instead)
SWITCHES = ("accept_graph", "row_block")


@contextmanager
def built_without(switches: list[str]):
    """Build an engine inside this with the attention kernel's per-token grid for every width, when asked."""
    saved = decode_attention.default_grid
    if "row_block" in switches:
        decode_attention.default_grid = lambda rows, tokens, group: "token"
    try:
        yield
    finally:
        decode_attention.default_grid = saved


GAP_US = 4.0  # gaps between kernels at most this long count as launch latency, longer ones as waits for the host
SHAPE = dict(hidden_size=1536, num_layers=24, num_heads=12, num_kv_heads=2, intermediate_size=4096, vocab_size=32000)


@dataclass(frozen=True)
class Workload:
    """What each decode runs: `batch` random 32-token prompts, request i decoding `tokens - i * tail // batch` new
    tokens (EOS ignored) at `temperature`, with output logprobs when `logprobs`."""

    batch: int
    tokens: int
    temperature: float = 0.0
    logprobs: bool = False
    tail: int = 0


def decode(core: EngineCore, w: Workload, seed: int, times: list | None = None) -> int:
    """Decode the workload's prompts (drawn from `seed`); returns the engine steps taken (and appends each step's end
    time, perf_counter, to `times`)."""
    g = torch.Generator().manual_seed(seed)
    for i, ids in enumerate(torch.randint(10, core.vocab_size, (w.batch, 32), generator=g).tolist()):
        core.add_request(Request(rid=f"{seed}-{i}", input_ids=ids, return_logprob=w.logprobs,
                                 params=SamplingParams(temperature=w.temperature,
                                                       max_new_tokens=w.tokens - i * w.tail // w.batch,
                                                       ignore_eos=True)))
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        if times is not None:
            times.append(time.perf_counter())
    return steps


class StepPhases:
    """Where one decode's wall time goes, by engine step (no profiler): each `step()` timed and filed under the k
    the step policy chose (0: a plain step; plain decoding's steps too) and whether fewer than TAIL_BATCH rows ran;
    the prefill and the drafter's catch-up before a draft (SpecWorker.catch_up) timed inside it, each followed by
    a sync so their device time counts (their host time alone is kept too), and the garbage collector's pauses.
    Why: a speculative engine at batch 128 ran slower than plain decoding with equal steady steps, so the time had
    to be somewhere else."""

    TAIL_BATCH = 64  # SGLang's adaptive tiers: below it the tier of 32 (candidates 0 and 1) decides

    def __init__(self):
        self.steps: list[tuple[int, int, float]] = []  # (k, rows, seconds)
        self.prefill_s, self.catch_up_s, self.catch_up_host_s = 0.0, 0.0, 0.0
        self.catch_ups: list[tuple[int, int]] = []  # (rows behind, most deferred steps of a row) per catch-up
        self.gc_s, self.gc_n, self._gc_t = [0.0, 0.0, 0.0], [0, 0, 0], 0.0  # per generation

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
        else:
            self.gc_s[info["generation"]] += time.perf_counter() - self._gc_t
            self.gc_n[info["generation"]] += 1

    @contextmanager
    def watching(self, core: EngineCore):
        """Instrument `core` (and its speculative worker's catch_up) while the block runs."""
        worker = core.spec_worker
        chose, real_step, real_prefill = [0], core.step, core._prefill
        real_catch_up = worker.catch_up if worker is not None else None
        sync = torch.cuda.synchronize if core.device.type == "cuda" else (lambda: None)  # engine_gpu.py --device cpu
        real_choose = core.policy.choose if core.policy is not None else None

        def choose(n):
            chose[0] = real_choose(n)
            return chose[0]

        def prefill(rows):
            sync()
            t = time.perf_counter()
            real_prefill(rows)
            sync()
            self.prefill_s += time.perf_counter() - t

        def catch_up(rows):
            pending = getattr(getattr(core.drafter, "mtp", core.drafter), "pending", None) or {}
            behind = [len(pending[r.slot]) for r in rows if r.slot in pending]
            t = time.perf_counter()
            switch_s = real_catch_up(rows)
            self.catch_up_host_s += time.perf_counter() - t
            sync()
            self.catch_up_s += time.perf_counter() - t
            if behind:
                self.catch_ups.append((len(behind), max(behind)))
            return switch_s

        def step():
            rows, chose[0] = sum(r.finish is None for r in core.running), 0
            t = time.perf_counter()
            out = real_step()
            self.steps.append((chose[0], rows, time.perf_counter() - t))
            return out

        core.step, core._prefill = step, prefill
        if worker is not None:
            worker.catch_up = catch_up
        if real_choose is not None:
            core.policy.choose = choose
        gc.callbacks.append(self._on_gc)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._on_gc)
            core.step, core._prefill = real_step, real_prefill
            if worker is not None:
                worker.catch_up = real_catch_up
            if real_choose is not None:
                core.policy.choose = real_choose

    def lines(self) -> list[str]:
        total = sum(s for _, _, s in self.steps)
        out = [f"  {len(self.steps)} steps, {total * 1e3:.1f} ms: prefill {self.prefill_s * 1e3:.1f} ms (synced); "
               f"{len(self.catch_ups)} catch-ups (rows, most deferred steps: {self.catch_ups[:4]}), "
               f"{self.catch_up_s * 1e3:.1f} ms synced ({self.catch_up_host_s * 1e3:.1f} ms host); garbage "
               "collections by generation: " + ", ".join(f"{n} in {s * 1e3:.1f} ms" for n, s in zip(self.gc_n,
                                                                                                   self.gc_s))]
        for k in sorted({k for k, _, _ in self.steps}):
            for tail in (False, True):
                each = [s * 1e3 for kk, n, s in self.steps if kk == k and (0 < n < self.TAIL_BATCH) == tail]
                if each:
                    out.append(f"  k={k}, {'under' if tail else 'at least'} {self.TAIL_BATCH} rows: {len(each)} "
                               f"steps, {sum(each):.1f} ms, median {statistics.median(each):.3f} ms, max "
                               f"{max(each):.3f} ms")
        return out


def profile_engine(core: EngineCore, w: Workload, top: int) -> list[str]:
    decode(core, w, seed=0)  # warm: graphs captured, kernels compiled
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        steps = decode(core, w, seed=1)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    busy, count, by_name, spans = 0.0, 0, defaultdict(float), []
    for e in prof.events():
        if e.device_type.name == "CUDA":
            busy += e.device_time
            count += 1
            by_name[e.name[:70]] += e.device_time
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    short = long = 0.0
    for (_, end), (start, _) in zip(spans, spans[1:]):
        gap = max(0.0, start - end)
        short, long = (short + gap, long) if gap <= GAP_US else (short, long + gap)
    ms = lambda us: us / 1e3 / steps  # noqa: E731
    lines = [f"{steps} steps: wall {wall * 1e3 / steps:.3f} ms/step, device busy {ms(busy):.3f} ms/step "
             f"({busy / 1e6 / wall:.0%}), idle {wall * 1e3 / steps - ms(busy):.3f} ms/step, "
             f"{count / steps:.0f} kernels/step",
             f"  gaps between kernels: {ms(short):.3f} ms/step of at most {GAP_US:g} us (launch latency), "
             f"{ms(long):.3f} ms/step longer (waiting for the host, or for the profiler)"]
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {ms(us):7.3f} ms/step  {name}")
    ops = [e for e in prof.key_averages() if e.key.startswith(("aten::", "cuda")) and e.count >= steps]
    lines.append("host: the ops launched most often (calls per step, host ms per step)")
    for e in sorted(ops, key=lambda e: -e.count)[:top]:
        lines.append(f"  {e.count / steps:6.1f}  {e.self_cpu_time_total / 1e3 / steps:7.3f} ms  {e.key}")
    return lines


def timed(core: EngineCore, w: Workload) -> str:
    """Wall ms per step without the profiler, and the host's wait for read-backs (the overlap schedule's)."""
    waits = getattr(core.overlap, "wait_s", None) is not None
    waited = core.overlap.wait_s if waits else 0.0
    torch.cuda.synchronize()
    t = time.perf_counter()
    ends = [t]
    steps = decode(core, w, seed=3, times=ends)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e3 / steps
    each = [(b - a) * 1e3 for a, b in zip(ends, ends[1:])]
    print(f"unprofiled steps: the first (prefill, first launch) {each[0]:.3f} ms, the second {each[1]:.3f}, median "
          f"of the rest {statistics.median(each[2:]):.3f}, the last (the drain) {each[-1]:.3f}")
    if not waits:
        return f"unprofiled: wall {wall:.3f} ms/step"
    wait = (core.overlap.wait_s - waited) * 1e3 / steps
    return (f"unprofiled: wall {wall:.3f} ms/step, host waiting for read-backs {wait:.3f} ms/step, "
            f"host busy {wall - wait:.3f}")


def graph_alone(core: EngineCore, replays: int = 200) -> str:
    """ms per replay of the captured plain step with no host work between replays (padded rows only: the scratch
    slot): the device's own time per step, launch latencies between its kernels included."""
    step = core.model.graphs.get("decode")
    if step is None or not step.graphs:
        return "no captured plain step"
    shape = max(step.graphs)
    graph = step.graphs[shape][0]
    step.meta[:, 0], step.meta[:, 1] = shape[2] - 1, step.scratch_slot  # attention over the whole key bucket
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return f"the captured step {shape} replayed alone: {(time.perf_counter() - t) * 1e3 / replays:.3f} ms/step"


def greedy_check(core: EngineCore, tokens: int = 24) -> str:
    """The graphed decode's greedy tokens against the same engine's eager forwards (graphs set aside): the same
    kernels without graphs or dependent launches, so the same bits are expected."""
    outs = []
    for graphs in (core.model.graphs, {}):
        saved, core.model.graphs = core.model.graphs, graphs
        prompt = [i % core.vocab_size for i in range(100, 132)]
        core.add_request(Request(rid=f"check{len(outs)}", input_ids=prompt, params=SamplingParams(
            temperature=0.0, max_new_tokens=tokens, ignore_eos=True)))
        done = []
        while core.has_work():
            done += core.step()
        core.model.graphs = saved
        outs.append(done[0].output_ids)
    return f"greedy tokens with graphs equal the eager forwards': {outs[0] == outs[1]}"


def host_profile(core: EngineCore, w: Workload, top: int) -> list[str]:
    """cProfile of the host's Python over a decode: the functions with the most time of their own."""
    prof = cProfile.Profile()
    prof.enable()
    steps = decode(core, w, seed=2)
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [f"cProfile over {steps} steps (tottime / cumtime are per run; divide by steps):"]
    return lines + [line for line in out.getvalue().splitlines() if line.strip()][-top - 1:]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="the chain's draft steps k")
    p.add_argument("--tokens", type=int, default=96, help="new tokens per request")
    p.add_argument("--top", type=int, default=12, help="kernels and host ops listed per engine")
    p.add_argument("--cprofile", action="store_true", help="also profile each engine's Python")
    p.add_argument("--engines", default="plain,spec", help="engines to profile, of plain, spec and adaptive")
    p.add_argument("--tail", type=int, default=0, help="request i decodes tokens - i * tail // batch tokens")
    p.add_argument("--phases", type=int, default=0, metavar="REPEATS",
                   help="instead of profiling, time this many interleaved decodes per engine by step kind (StepPhases)")
    p.add_argument("--model", default=None, help="a checkpoint with one MTP layer (e.g. the GPU demo's "
                   "outputs/demo/model_sft) instead of a random one of the 0.7B shape")
    p.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (RL rollouts: 1)")
    p.add_argument("--logprobs", action="store_true", help="the requests ask for output logprobs, as RL rollouts do")
    p.add_argument("--vocab", type=int, default=SHAPE["vocab_size"], help="the random model's vocabulary (Qwen's: "
                   "151936)")
    p.add_argument("--without", action="append", default=[], metavar="KERNEL[,KERNEL]",
                   help="also build each engine without these kernels (fields of kernels.ops.Kernels: gemv, "
                   "attention, norm, activation, sampling), accept_graph (a chain's acceptance eager) or "
                   "row_block (the attention kernel's per-token grid for a verify), "
                   "timed side by side with all of them (--phases)")
    a = p.parse_args(argv)
    engines = set(a.engines.split(","))
    w = Workload(a.batch, a.tokens, a.temperature, a.logprobs, a.tail)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; temperature {a.temperature}, "
          f"logprobs {a.logprobs}")
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model or make_tiny_model(Path(tmp) / "mimo", arch="mimo", mtp_layers=1, dtype="bfloat16",
                                          max_position_embeddings=1024, **{**SHAPE, "vocab_size": a.vocab})
        # with a tail the batch shrinks: capture engine_gpu.py's sizes, so its rows pad as that bench's do
        graphs = CudaGraphSettings(batch_sizes=tuple(sorted({1, 8, 32, a.batch})) if a.tail else (a.batch,))
        cores = {}
        variants = {"all kernels": (Kernels.from_values({}), [])}  # name -> (kernels, graphs set aside)
        for off in a.without:
            names = off.split(",")
            variants[f"without {off}"] = (
                dataclasses.replace(variants["all kernels"][0], **{k: False for k in names if k not in SWITCHES}),
                [k for k in names if k in SWITCHES])
        for (key, name, spec), variant in itertools.product((
                ("plain", "plain", None),
                ("spec", f"NEXTN k={a.steps}", SpecConfig("EAGLE", a.steps, 1, a.steps + 1)),
                ("adaptive", "NEXTN k=3, adaptive (random drafts: it settles on plain steps)",
                 SpecConfig("EAGLE", 3, 1, 4, speculative_adaptive=True))), variants):
            if key not in engines:
                continue
            name += f", {variant}" if len(variants) > 1 else ""
            with built_without(variants[variant][1]):
                core = EngineCore(str(path), spec, dtype="bfloat16", device="cuda", max_running_requests=a.batch,
                                  context_length=32 + a.tokens + max(a.steps, 3) + 8, cuda_graph=graphs,
                                  kernels=variants[variant][0])
            if "accept_graph" in variants[variant][1]:
                core.model.graphs.pop("chain_accept", None)  # plain decoding captures none
            if a.phases:
                decode(core, w, seed=0)  # warm: graphs captured, kernels compiled
                cores[name] = core
                continue
            print(f"\n{name}, batch {a.batch}:")
            print("\n".join(profile_engine(core, w, a.top)), flush=True)
            if key != "spec":
                print(timed(core, w), flush=True)
            if spec is None:
                print(graph_alone(core), flush=True)
                print(greedy_check(core), flush=True)
            if a.cprofile:
                print("\n".join(host_profile(core, w, 3 * a.top)), flush=True)
            del core
        decode_ms, step_ms = defaultdict(list), defaultdict(list)
        for r in range(a.phases):
            for name, core in cores.items():
                phases = StepPhases()
                torch.cuda.synchronize()
                t = time.perf_counter()
                with phases.watching(core):
                    decode(core, w, seed=10 + r)
                torch.cuda.synchronize()
                decode_ms[name].append((time.perf_counter() - t) * 1e3)
                step_ms[name].append(statistics.median(s for _, _, s in phases.steps[1:]) * 1e3)
                print(f"{name}, batch {a.batch}, tail {a.tail}, repeat {r}: {decode_ms[name][-1]:.1f} ms")
                print("\n".join(phases.lines()), flush=True)
        if cores:
            print("\n".join(phase_summary(decode_ms, step_ms, list(variants))))


def phase_summary(decode_ms: dict, step_ms: dict, variants: list[str]) -> list[str]:
    """Median whole decode and median step per engine over the repeats, and, with several kernel variants, each
    engine's time in the others as a ratio to all kernels (interleaved in one process: side by side)."""
    lines = ["median over the repeats: engine, decode ms, step ms (steps after the prefill)"]
    for name in decode_ms:
        lines.append(f"  {name}: {statistics.median(decode_ms[name]):.1f} ms, {statistics.median(step_ms[name]):.3f}")
    first = f", {variants[0]}"
    for name in [n for n in decode_ms if n.endswith(first)]:
        for other in variants[1:]:
            twin = name[: -len(first)] + f", {other}"
            lines.append(f"  {name[: -len(first)]}: {other} / {variants[0]} = "
                         f"{statistics.median(decode_ms[twin]) / statistics.median(decode_ms[name]):.2f}x decode, "
                         f"{statistics.median(step_ms[twin]) / statistics.median(step_ms[name]):.2f}x step")
    return lines


if __name__ == "__main__":
    main()
