"""The loop's engine probes against SGLang's generating health routes, same run.

Before every rollout and eval, and before each sync where the engines keep generating (the split layout), the
driver checks that every engine still generates (`EngineClient.liveness_problem(generate=True)`). SGLang's
/health_generate sends its scheduler one greedy token and then polls once a second, so it never answers in under
1 s; the probe the loop sends now is that same request through /generate, answered when the token is out. An engine
being started is ready when SGLang's /ready says so (its warmup generation done) instead of /health, which generates
and polls as /health_generate does. This times each pair against one idle engine server (the embedded engine behind
SGLang's front end), interleaved, and prints the medians and their ratios.

    python bench/liveness_probe.py [--rounds 10] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

if not __package__:  # `python bench/<name>.py`: import bench as a package, from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.weight_sync import small_cache_flags, start_engine
from slime_spec.fleet.client import EngineClient
from slime_spec.tools.tiny_model import make_tiny_model


def time_get(url: str, path: str) -> float:
    t0 = time.perf_counter()
    status = requests.get(url + path, timeout=60).status_code
    if status != 200:
        raise RuntimeError(f"{url}{path} answered HTTP {status}")
    return time.perf_counter() - t0


def time_generation_probe(client: EngineClient) -> float:
    t0 = time.perf_counter()
    problem = client.liveness_problem(generate=True)
    if problem is not None:
        raise RuntimeError(f"the generating probe failed: {problem}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="probes of each kind, interleaved")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_liveness_probe_"))
    model = make_tiny_model(work / "model", seed=0, arch="mimo", hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=128, max_position_embeddings=256, mtp_layers=1)
    proc, url = start_engine(model, a.device, None, work / "engine.log", small_cache_flags(256, 2))
    try:
        client = EngineClient(url)
        probes = {"/health_generate": lambda: time_get(url, "/health_generate"),
                  "generate": lambda: time_generation_probe(client),
                  "/health": lambda: time_get(url, "/health"), "/ready": lambda: time_get(url, "/ready")}
        seconds = {name: [] for name in probes}
        for probe in probes.values():  # warm-up
            probe()
        for _ in range(a.rounds):
            for name, probe in probes.items():
                seconds[name].append(probe())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ms = {name: statistics.median(s) * 1e3 for name, s in seconds.items()}
    print(f"engine probes, one idle engine on {a.device}, median of {a.rounds} interleaved rounds")
    print("| probe | ms | speed-up |\n|---|---|---|")
    print(f"| liveness: SGLang's /health_generate | {ms['/health_generate']:.1f} | 1.00x |")
    print(f"| liveness: one token through /generate (the loop's) | {ms['generate']:.1f} | "
          f"{ms['/health_generate'] / ms['generate']:.1f}x |")
    print(f"| readiness: SGLang's /health | {ms['/health']:.1f} | 1.00x |")
    print(f"| readiness: SGLang's /ready (the fleet's) | {ms['/ready']:.1f} | {ms['/health'] / ms['/ready']:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
