"""CUDA-graph capture of a speculative engine: graphs for every verify width up to k + 1 against only the widths
the step policy runs (`verify_widths`), side by side in one process.

The engine is the GPU demo's (a 0.5B MiMo-shaped target, 34 layers of hidden 1024, one MTP layer; NEXTN k = 3,
bfloat16, 128 running requests). For each way, alternating `--rounds` times: the target's and the MTP layer's graphs
captured again (`graph_model`, as the engine captures them at start), the seconds and the number of graphs, then
128 requests decoded greedily (64 new tokens each) with those graphs: wall seconds, and whether the tokens equal those
of an untimed decode with the graphs the engine captured at start. Prints the ratio of the capture times.

    python bench/graph_capture_gpu.py
    python bench/graph_capture_gpu.py --size tiny --rounds 1 --device cpu   # the script's check (nothing captured)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if not __package__:  # `python bench/<name>.py`: import bench as a package, from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import publish
from bench.engine_memory_saver_gpu import SIZES

WAYS = {"every width up to k + 1 (before)": False, "the policy's widths (now)": True}


def capture(core, policy_widths: bool) -> tuple[float, int]:
    """The engine's graphs captured again by the engine itself (`EngineCore.capture_graphs`), at the policy's widths
    or, with its `verify_widths` answering none, at every width up to k + 1; (seconds, graphs)."""
    if policy_widths:
        vars(core.policy).pop("verify_widths", None)
    else:
        core.policy.verify_widths = tuple  # () : graph_model's every width up to max_draft_tokens + 1
    core.model.graphs = {}
    gc.collect()
    if core.device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    core.capture_graphs()
    seconds = time.perf_counter() - t0
    return seconds, sum(len(g.batch_sizes) * len(g.token_counts) * len(g.key_counts)  # shapes, one graph each
                        for g in core.model.graphs.values())


def decode(core, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
    from slime_spec.engine.managers.engine_core import Request, SamplingParams
    from tests.helpers.engine_runs import run_to_completion
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True))
                for i, p in enumerate(prompts)]
    sync = torch.cuda.synchronize if core.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = run_to_completion(core, requests)
    sync()
    return time.perf_counter() - t0, [outs[r.rid].output_ids for r in requests]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=tuple(SIZES), default="demo")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.speculative.settings import SpecConfig
    from slime_spec.tools.tiny_model import make_tiny_model
    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="bench_graphs_")) / "m", arch="mimo", mtp_layers=1,
                            max_position_embeddings=512, dtype="bfloat16", **SIZES[a.size])
    t0 = time.perf_counter()
    core = EngineCore(str(model), SpecConfig("EAGLE", 3, 1, 4), dtype="bfloat16", device=a.device,
                      max_running_requests=a.requests)
    card = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    print(f"{card}, torch {torch.__version__}: engine built in "
          f"{time.perf_counter() - t0:.1f} s, of which graph capture {core.graph_capture_seconds:.1f} s", flush=True)
    prompts = [[5 + (i * 7 + j) % 40 for j in range(12)] for i in range(a.requests)]
    rows: dict[str, list[tuple[float, int, float, bool]]] = {w: [] for w in WAYS}
    reference = decode(core, prompts, a.max_new_tokens)[1]  # untimed: the first decode's one-off costs
    for r in range(a.rounds):
        for way, policy_widths in (WAYS.items() if r % 2 == 0 else reversed(WAYS.items())):
            seconds, graphs = capture(core, policy_widths)
            wall, tokens = decode(core, prompts, a.max_new_tokens)
            rows[way].append((seconds, graphs, wall, tokens == reference))
            print(f"round {r}, {way}: capture {seconds:.1f} s ({graphs} graphs), decode {wall:.3f} s", flush=True)
    med = {w: (statistics.median(x[0] for x in v), v[0][1], statistics.median(x[2] for x in v),
               all(x[3] for x in v)) for w, v in rows.items()}
    table = (f"NEXTN k = 3, {a.size} MiMo + MTP, bfloat16, {a.requests} running requests, median of {a.rounds} "
             f"alternating rounds\n\n| graphs for | graphs | capture s | greedy decode of {a.requests} x "
             f"{a.max_new_tokens} tokens, s | tokens equal |\n| --- | ---: | ---: | ---: | --- |\n")
    table += "\n".join(f"| {w} | {g} | {c:.1f} | {d:.3f} | {eq} |" for w, (c, g, d, eq) in med.items())
    (before, after) = med.values()
    ratio = f"{before[0] / after[0]:.2f}x" if after[0] > 0 else "n/a (nothing captured on CPU)"
    table += f"\n\ncapture, before / now: {ratio}; decode, before / now: {before[2] / after[2]:.2f}x"
    publish(table, a.out)
    return 0 if all(m[3] for m in med.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
