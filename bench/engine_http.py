"""The embedded server's per-request cost: one batched /generate of N prompts vs N concurrent single calls.

    python bench/engine_http.py [--quick] [--model DIR] [--requests 8,32,128] [--max-new-tokens N] [--repeats N]

The server runs in a child process (as the rollout talks to it) with EngineCore.step timed inside it, so each
row splits wall time into engine compute (the sum of step() calls) and everything outside it: HTTP, JSON,
tokenization, the engine thread's queues, and steps that run with part of the batch because requests arrived
one by one. The two shapes run interleaved, `--repeats` times; each row reports the median.
Default model: the demo's shape (random MiMo, hidden 128, 6 layers), temperature 1, EOS ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from slime_spec.tiny_model import make_tiny_model


def serve(model: str, port: int, max_running: int) -> None:
    """The embedded server (as `python -m slime_spec.engine`) plus GET /bench/engine_seconds."""
    import uvicorn

    from slime_spec.engine.__main__ import make_core_factory
    from slime_spec.engine.http_server import create_app
    from slime_spec.engine.scheduler import EngineLoop
    from slime_spec.engine.server_args import parse_server_args
    from slime_spec.engine.weight_updater import WeightUpdater

    args = parse_server_args(["--model-path", model, "--port", str(port), "--max-running-requests", str(max_running)])
    spent = [0.0]
    make_core = make_core_factory(args)

    def timed_core():
        core = make_core()
        step = core.step

        def timed_step():
            t0 = time.perf_counter()
            try:
                return step()
            finally:
                spent[0] += time.perf_counter() - t0

        core.step = timed_step
        return core

    loop = EngineLoop(timed_core)
    loop.start()
    app = create_app(args, loop, WeightUpdater(args.weight_version, args.model_path, args.device, False))
    app.add_api_route("/bench/engine_seconds", lambda: {"seconds": spent[0]}, methods=["GET"])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def engine_seconds(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/bench/engine_seconds") as r:
        return (await r.json())["seconds"]


async def generate(session: aiohttp.ClientSession, url: str, payload: dict) -> list[dict] | dict:
    async with session.post(f"{url}/generate", json=payload) as r:
        if r.status != 200:
            raise RuntimeError(f"/generate answered {r.status}: {await r.text()}")
        return await r.json()


async def one_run(session, url: str, prompts: list[list[int]], params: dict, batched: bool) -> tuple[float, float, int]:
    """(wall seconds, engine step seconds, generated tokens) for one shape."""
    before = await engine_seconds(session, url)
    start = time.perf_counter()
    if batched:
        outs = await generate(session, url, {"input_ids": prompts, "sampling_params": params})
    else:
        outs = await asyncio.gather(*(generate(session, url, {"input_ids": p, "sampling_params": params})
                                      for p in prompts))
    wall = time.perf_counter() - start
    spent = await engine_seconds(session, url) - before
    return wall, spent, sum(o["meta_info"]["completion_tokens"] for o in outs)


async def measure(url: str, sizes: list[int], max_new: int, repeats: int) -> list[dict]:
    params = {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True}
    rows = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await one_run(session, url, [[5, 6, 7]] * 2, params, batched=True)  # warm-up
        for n in sizes:
            prompts = [[5 + (i * 7 + j) % 40 for j in range(12)] for i in range(n)]
            runs = {True: [], False: []}
            for _ in range(repeats):
                for batched in (True, False):
                    runs[batched].append(await one_run(session, url, prompts, params, batched))
            for batched, rs in runs.items():
                wall = statistics.median(r[0] for r in rs)
                spent = statistics.median(r[1] for r in rs)
                tokens = statistics.median(r[2] for r in rs)
                rows.append({"shape": "one batched /generate" if batched else f"{n} concurrent single calls",
                             "n": n, "wall_s": wall, "engine_s": spent, "outside": 1 - spent / wall,
                             "tokens_per_s": tokens / wall})
            print(to_markdown(rows[-2:]), flush=True)
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = ["| requests | shape | wall s | engine step s | share outside the engine | tokens/s |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['shape']} | {r['wall_s']:.3f} | {r['engine_s']:.3f} | {r['outside']:.0%} | "
                     f"{r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the bench server exited with {proc.returncode} before it was ready")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the bench server at {url} was not ready after {timeout_s:.0f}s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 and 32 requests, 32 new tokens, one repeat")
    p.add_argument("--model", default=None, help="a checkpoint directory (default: a random demo-shaped MiMo)")
    p.add_argument("--requests", default=None, help="comma-separated request counts (default 8,32,128)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (--quick 32)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved runs per row (default 3, --quick 1)")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--serve", nargs=3, metavar=("MODEL", "PORT", "MAX_RUNNING"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        serve(a.serve[0], int(a.serve[1]), int(a.serve[2]))
        return 0
    sizes = [int(x) for x in (a.requests or ("8,32" if a.quick else "8,32,128")).split(",")]
    max_new = a.max_new_tokens or (32 if a.quick else 64)
    repeats = a.repeats or (1 if a.quick else 3)
    model = a.model or str(make_tiny_model(Path(tempfile.mkdtemp(prefix="bench_http_")) / "mimo", arch="mimo",
                                           hidden_size=128, num_layers=6, intermediate_size=384, num_heads=4,
                                           num_kv_heads=2, max_position_embeddings=512))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", model, str(port), str(max(sizes))])
    try:
        wait_ready(url, proc)
        rows = asyncio.run(measure(url, sizes, max_new, repeats))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    table = (f"Embedded server, per-request cost: {model}, temperature 1, {max_new} new tokens per request, "
             f"median of {repeats} interleaved runs.\n\n" + to_markdown(rows))
    print("\n" + table)
    if a.out:
        Path(a.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
