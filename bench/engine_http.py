"""The embedded server's per-request cost: one batched /generate of N prompts vs N concurrent single calls.

    python bench/engine_http.py [--quick] [--model DIR] [--requests 8,32,128] [--max-new-tokens N] [--repeats N]
                                [--baseline-pythonpath DIR]

The server is `python -m slime_spec.engine` in a child process (as the rollout talks to it): SGLang's HTTP
server, TokenizerManager and DetokenizerManager in front of our scheduler process. Each row splits wall time
into engine compute (`engine_step_s` of /server_info's internal state: the sum of EngineCore.step calls) and
everything outside it: HTTP, JSON, tokenization, the ZMQ hops to the scheduler and the detokenizer, the engine
thread's queues, and steps that run with part of the batch because requests arrived one by one. The two shapes
run interleaved, `--repeats` times; each row reports the median.

`--baseline-pythonpath DIR` also starts the server `python -m slime_spec.engine` runs with its slime_spec imported
from DIR (e.g. a copy of an earlier slime_spec); both serve at once, each repeat runs every shape on one and then
the other (so a change in the machine's load hits both alike), and both are printed side by side with the ratio
of wall times.
Default model: the demo's shape (random MiMo, hidden 128, 6 layers), temperature 1, EOS ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from slime_spec.tiny_model import make_tiny_model


async def engine_seconds(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/server_info") as r:
        return (await r.json())["internal_states"][0]["engine_step_s"]


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


async def measure(urls: list[str], sizes: list[int], max_new: int, repeats: int) -> list[list[dict]]:
    """Rows per server; every server runs each shape in turn within one repeat, so load drift hits them alike."""
    params = {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True}
    rows: list[list[dict]] = [[] for _ in urls]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for url in urls:
            await one_run(session, url, [[5, 6, 7]] * 2, params, batched=True)  # warm-up
        for n in sizes:
            prompts = [[5 + (i * 7 + j) % 40 for j in range(12)] for i in range(n)]
            runs = [{True: [], False: []} for _ in urls]
            for _ in range(repeats):
                for k, url in enumerate(urls):
                    for batched in (True, False):
                        runs[k][batched].append(await one_run(session, url, prompts, params, batched))
            for k in range(len(urls)):
                for batched, rs in runs[k].items():
                    wall = statistics.median(r[0] for r in rs)
                    spent = statistics.median(r[1] for r in rs)
                    tokens = statistics.median(r[2] for r in rs)
                    rows[k].append({"shape": "one batched /generate" if batched else f"{n} concurrent single calls",
                                    "n": n, "wall_s": wall, "engine_s": spent, "outside": 1 - spent / wall,
                                    "tokens_per_s": tokens / wall})
            print(to_markdown(rows[0][-2:]), flush=True)
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = ["| requests | shape | wall s | engine step s | share outside the engine | tokens/s |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['shape']} | {r['wall_s']:.3f} | {r['engine_s']:.3f} | {r['outside']:.0%} | "
                     f"{r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def server_process(model: str, max_running: int, log_dir: Path, baseline_path: str | None = None):
    """`python -m slime_spec.engine` (its slime_spec imported from `baseline_path` if given, ahead of the working
    directory that `-m` puts first on sys.path)."""
    import sys

    from slime_spec.engines.process import ServerProcess, embedded_server_process
    from slime_spec.net import free_port

    flags = ["--max-running-requests", str(max_running), "--skip-server-warmup"]
    if baseline_path is None:
        return embedded_server_process(model, flags, log_path=log_dir / "server.log")
    port = free_port()
    run = (f"import runpy, sys; sys.path.insert(0, {baseline_path!r}); "
           "runpy.run_module('slime_spec.engine', run_name='__main__', alter_sys=True)")
    return ServerProcess([sys.executable, "-c", run, "--model-path", model, "--host", "127.0.0.1", "--port",
                          str(port), *flags], host="127.0.0.1", port=port, log_path=log_dir / "baseline.log",
                         expect_model_path=model)


def side_by_side(rows: list[dict], base: list[dict]) -> str:
    lines = ["| requests | shape | wall s | baseline wall s | wall / baseline | share outside the engine | "
             "baseline share outside |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r, b in zip(rows, base):
        lines.append(f"| {r['n']} | {r['shape']} | {r['wall_s']:.3f} | {b['wall_s']:.3f} | "
                     f"{r['wall_s'] / b['wall_s']:.2f} | {r['outside']:.0%} | {b['outside']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 and 32 requests, 32 new tokens, one repeat")
    p.add_argument("--model", default=None, help="a checkpoint directory (default: a random demo-shaped MiMo)")
    p.add_argument("--requests", default=None, help="comma-separated request counts (default 8,32,128)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (--quick 32)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved runs per row (default 3, --quick 1)")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--baseline-pythonpath", default=None,
                   help="also measure the server whose slime_spec is imported from this directory, side by side")
    a = p.parse_args(argv)
    sizes = [int(x) for x in (a.requests or ("8,32" if a.quick else "8,32,128")).split(",")]
    max_new = a.max_new_tokens or (32 if a.quick else 64)
    repeats = a.repeats or (1 if a.quick else 3)
    model = a.model or str(make_tiny_model(Path(tempfile.mkdtemp(prefix="bench_http_")) / "mimo", arch="mimo",
                                           hidden_size=128, num_layers=6, intermediate_size=384, num_heads=4,
                                           num_kv_heads=2, max_position_embeddings=512))
    log_dir = Path(tempfile.mkdtemp(prefix="bench_http_logs_"))
    servers = [server_process(model, max(sizes), log_dir)]
    if a.baseline_pythonpath:
        servers.append(server_process(model, max(sizes), log_dir, a.baseline_pythonpath))
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready(600)
        rows = asyncio.run(measure([s.url for s in servers], sizes, max_new, repeats))
    finally:
        for server in servers:
            server.stop()
    table = (f"Embedded server, per-request cost: {model}, temperature 1, {max_new} new tokens per request, "
             f"median of {repeats} interleaved runs.\n\n" + to_markdown(rows[0]))
    if a.baseline_pythonpath:
        table += (f"\n\nAgainst the baseline server (slime_spec from {a.baseline_pythonpath}), both serving at once, "
                  f"runs alternating between them:\n\n" + side_by_side(rows[0], rows[1]))
    print("\n" + table)
    if a.out:
        Path(a.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
