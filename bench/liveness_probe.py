"""The loop's generating liveness probe: SGLang's /health_generate against one token through /generate, same run.

Before every rollout and eval, and before each sync where the engines keep generating (the split layout), the
driver checks that every engine still generates (`EngineClient.liveness_problem(generate=True)`). SGLang's
/health_generate sends its scheduler one greedy token and then polls once a second, so it never answers in under
1 s; the probe the loop sends now is that same request through /generate, answered when the token is out. This
times both against one idle engine server (the embedded engine behind SGLang's front end), interleaved, and prints
the medians and their ratio.

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


def time_health_generate(url: str) -> float:
    t0 = time.perf_counter()
    status = requests.get(url + "/health_generate", timeout=60).status_code
    if status != 200:
        raise RuntimeError(f"{url}/health_generate answered HTTP {status}")
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
        time_health_generate(url), time_generation_probe(client)  # warm-up
        sglang_s, probe_s = [], []
        for _ in range(a.rounds):
            sglang_s.append(time_health_generate(url))
            probe_s.append(time_generation_probe(client))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    health, probe = statistics.median(sglang_s), statistics.median(probe_s)
    print(f"generating liveness probe, one idle engine on {a.device}, median of {a.rounds} interleaved rounds")
    print("| probe | ms | speed-up |\n|---|---|---|")
    print(f"| SGLang's /health_generate | {health * 1e3:.1f} | 1.00x |")
    print(f"| one token through /generate (the loop's) | {probe * 1e3:.1f} | {health / probe:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
