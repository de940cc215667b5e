"""Does the colocated cycle slow an engine down? Two identical speculative servers, one put through the cycle.

In the colocated GPU demo the rollout engine (engine 0) decodes the speed-up probe's prompts 10-25% slower than the
frozen-draft engine beside it, a twin never released, although its draft is accepted more often; in the split layout
the two are even. This bench starts two servers of the same model with the same flags (A and B), times them in turn
on the same batch (greedy, so both do exactly the same work), then puts A, and only A, through what the colocated loop
does to engine 0 each step, timing both after each phase:

  release   /release_memory_occupation (every tag), then /resume_memory_occupation (every tag)
  sync      a weight sync of the same values over the tensor transport the colocated loop uses (WeightSyncer:
            pause, begin, one update per bucket from this process's tensors, end, continue)
  cycle     the loop's order: release every tag, resume the weights, the sync, resume the CUDA graphs and KV cache

and prints A / B wall time per phase (median of --repeats interleaved runs): 1.00 where a phase leaves A as fast as
its twin.

    python bench/engine_cycle.py                      # on a GPU machine: the GPU demo's engine shape, memory saver
    python bench/engine_cycle.py --size tiny --device cpu --requests 16 --max-new-tokens 16   # the script's check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

if not __package__:  # `python bench/<name>.py`: import bench as a package, from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import publish
from bench.engine_http import one_run, server_process
from bench.engine_memory_saver_gpu import SIZES
from slime_spec.fleet.client import EngineClient
from slime_spec.tools.tiny_model import make_tiny_model

NEXTN = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4")


def served_tensors(model: Path, device: str):
    """The checkpoint's tensors on `device`, as the trainer's sync sends them (HF names, MTP tensors marked)."""
    from safetensors.torch import load_file

    from slime_spec.weight_sync.gather import iter_hf_state
    state = {}
    for f in sorted(model.glob("*.safetensors")):
        state.update(load_file(str(f), device=device))
    return list(iter_hf_state(state, json.loads((model / "config.json").read_text())))


def make_syncer(url: str, model: Path):
    from slime_spec.config.run_config import WeightSyncConfig
    from slime_spec.weight_sync.protocol import SpecSetup
    from slime_spec.weight_sync.sync import WeightSyncer
    config = json.loads((model / "config.json").read_text())
    return WeightSyncer([EngineClient(url)], WeightSyncConfig(update_weight_buffer_size=512 << 20,
                                                              weight_sync_check_interval=10 ** 6),
                        hf_config=config, hf_checkpoint=model, has_mtp_layers=True,
                        spec=SpecSetup("NEXTN", None, str(model)), transport="tensor", colocate=True)


async def time_pair(servers, prompts: list[list[int]], params: dict, group: int, repeats: int) -> tuple[float, float]:
    """Median wall seconds of A and of B, each decoding every prompt (sent `group` at a time), runs alternating."""
    walls: list[list[float]] = [[], []]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=1.0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for r in range(repeats):
            order = [0, 1] if r % 2 == 0 else [1, 0]
            for k in order:
                url, pid = servers[k]
                walls[k].append((await one_run(session, url, pid, prompts, params, group, False))[0])
    return statistics.median(walls[0]), statistics.median(walls[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=tuple(SIZES), default="demo")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--group-size", type=int, default=8, help="prompts per batched /generate, as a GRPO group")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs per server per phase")
    p.add_argument("--cycles", type=int, default=2, help="times the loop's whole cycle is repeated")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    a = p.parse_args(argv)

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="bench_cycle_")) / "m", arch="mimo", mtp_layers=1,
                            max_position_embeddings=512, dtype="bfloat16" if a.device == "cuda" else "float32",
                            **SIZES[a.size])
    flags = ("--device", a.device, *NEXTN) + (("--enable-memory-saver",) if a.device == "cuda" else ())
    log_dir = Path(tempfile.mkdtemp(prefix="bench_cycle_logs_"))
    servers = [server_process(str(model), a.requests, log_dir, server_flags=flags, log_name=f"server_{n}.log")
               for n in "AB"]
    prompts = [[5 + (i * 7 + j) % 40 for j in range(12)] for i in range(a.requests)]
    params = {"temperature": 0.0, "max_new_tokens": a.max_new_tokens, "ignore_eos": True}
    rows = []
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready(600)
        pair = [(s.url, s.pid) for s in servers]
        url = servers[0].url
        engine_a = EngineClient(url)
        syncer = make_syncer(url, model)
        tensors = served_tensors(model, a.device)

        def measure(phase: str, seconds: float = 0.0) -> None:
            wall_a, wall_b = asyncio.run(time_pair(pair, prompts, params, a.group_size, a.repeats))
            rows.append((phase, wall_a, wall_b, seconds))
            print(f"{phase}: A {wall_a:.4f} s, B {wall_b:.4f} s, A / B {wall_a / wall_b:.3f}", flush=True)

        asyncio.run(time_pair(pair, prompts, params, a.group_size, 1))  # warm-up, untimed
        measure("both as started")
        t0 = time.perf_counter()
        engine_a.post("/release_memory_occupation", {})
        engine_a.post("/resume_memory_occupation", {})
        measure("A released and resumed (every tag)", time.perf_counter() - t0)
        t0 = time.perf_counter()
        syncer.sync_report(iter(tensors), "same-values")
        measure("A synced (tensor transport, same values)", time.perf_counter() - t0)
        for c in range(a.cycles):
            t0 = time.perf_counter()
            engine_a.post("/release_memory_occupation", {})
            engine_a.post("/resume_memory_occupation", {"tags": ["weights"]})
            syncer.sync_report(iter(tensors), f"cycle-{c}")
            engine_a.post("/resume_memory_occupation", {"tags": ["cuda_graph", "kv_cache"]})
            measure(f"A through the loop's cycle ({c + 1})", time.perf_counter() - t0)
        syncer.close()
        engine_a.close()
    finally:
        for s in servers:
            s.stop()
    table = (f"Two identical servers ({a.size} MiMo + MTP, {' '.join(flags)}), {a.requests} prompts in groups of "
             f"{a.group_size}, greedy, {a.max_new_tokens} new tokens, median of {a.repeats} interleaved runs; only A "
             f"goes through each phase.\n\n| phase | phase s | A wall s | B wall s | A / B |\n| --- | ---: | ---: | "
             "---: | ---: |\n")
    table += "\n".join(f"| {ph} | {s:.3f} | {wa:.4f} | {wb:.4f} | {wa / wb:.3f} |" for ph, wa, wb, s in rows)
    publish(table, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
