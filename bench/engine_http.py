"""The embedded server's per-request cost: one batched /generate of N prompts vs N concurrent single calls (and,
with `--group-size G`, N / G concurrent batched calls of G: how the rollout sends GRPO groups).

    python bench/engine_http.py [--quick] [--model DIR] [--requests 8,32,128] [--max-new-tokens N] [--repeats N]
                                [--server-flags "SGLANG FLAGS"] [--return-logprob] [--plain-twins] [--group-size G]
                                [--baseline-pythonpath DIR | --limits 32,128]

The server is `python -m slime_spec.engine` in a child process (as the rollout talks to it): SGLang's HTTP
server, TokenizerManager and DetokenizerManager in front of our scheduler process. Each row splits wall time
into engine compute (`engine_step_s` of /server_info's internal state: the sum of EngineCore.step calls) and
everything outside it: HTTP, JSON, tokenization, the ZMQ hops to the scheduler and the detokenizer, the engine
thread's queues, and steps that run with part of the batch because requests arrived one by one. The two shapes
run interleaved, `--repeats` times; each row reports the median. "front-end CPU ms / request" is the CPU time of the
server's processes other than its scheduler process (SGLang's HTTP server and TokenizerManager, its
DetokenizerManager) per request: the work those processes take from the cores the engine runs on.

`--baseline-pythonpath DIR` also starts the server `python -m slime_spec.engine` runs with its slime_spec imported
from DIR (e.g. a copy of an earlier slime_spec); both serve at once, each repeat runs every shape on both, the
order alternating between repeats (so a change in the machine's load hits both alike), and both are printed side
by side with the ratio of wall times. `--limits 32,128` instead starts one server per `--max-running-requests`
value (each with its plain twin under `--plain-twins`): a rollout decoded in waves against one decoded at once.
Default model: the demo's shape (random MiMo, hidden 128, 6 layers), temperature 1, EOS ignored. `--server-flags`
adds SGLang flags to every server (e.g. the demo's NEXTN flags); `--return-logprob` asks for the output logprobs,
as the rollout does. `--plain-twins` (with speculative `--server-flags`) starts a plain server beside each one, timed in
turn with the others, and prints each side's spec_speedup (plain wall / speculative wall), as the demo measures it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

if not __package__:  # `python bench/<name>.py`: import bench as a package, from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import publish
from slime_spec.speculative.speedup import without_speculative_flags
from slime_spec.tools.tiny_model import make_tiny_model

SCHEDULER_TITLE = "sglang::schedul"  # the scheduler process's title (psutil gives it whole, the kernel 15 characters)


async def engine_seconds(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/server_info") as r:
        return (await r.json())["internal_states"][0]["engine_step_s"]


async def generate(session: aiohttp.ClientSession, url: str, payload: dict) -> list[dict] | dict:
    async with session.post(f"{url}/generate", json=payload) as r:
        if r.status != 200:
            raise RuntimeError(f"/generate answered {r.status}: {await r.text()}")
        return await r.json()


def front_end_cpu_seconds(pid: int) -> float:
    """CPU seconds so far of the server process `pid` and its children, its scheduler process left out."""
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            if not proc.name().startswith(SCHEDULER_TITLE):
                t = proc.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def one_run(session, url: str, pid: int, prompts: list[list[int]], params: dict, group: int,
                  return_logprob: bool) -> tuple[float, float, int, float]:
    """(wall seconds, engine step seconds, generated tokens, front-end CPU seconds) for one shape: the prompts sent
    `group` at a time as concurrent batched calls (all of them: one batched call; 1: one call each)."""
    before, cpu_before = await engine_seconds(session, url), front_end_cpu_seconds(pid)
    start = time.perf_counter()
    extra = {"return_logprob": True} if return_logprob else {}
    if group > 1:
        answers = await asyncio.gather(*(generate(session, url, {"input_ids": prompts[i:i + group],
                                                                 "sampling_params": params, **extra})
                                         for i in range(0, len(prompts), group)))
        outs = [o for answer in answers for o in answer]
    else:
        outs = await asyncio.gather(*(generate(session, url, {"input_ids": p, "sampling_params": params, **extra})
                                      for p in prompts))
    wall = time.perf_counter() - start
    cpu = front_end_cpu_seconds(pid) - cpu_before
    spent = await engine_seconds(session, url) - before
    return wall, spent, sum(o["meta_info"]["completion_tokens"] for o in outs), cpu


def rollout_prompts(path: str, model: str, n: int, samples: int = 8) -> list[list[int]]:
    """n prompts as a GRPO rollout sends them: each of the file's first n / samples prompts (its "prompt" field)
    `samples` times, tokenized as the rollout tokenizes (rollout/data.py: no special tokens)."""
    import json

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    with open(path) as f:
        texts = [json.loads(line)["prompt"] for line, _ in zip(f, range(-(-n // samples)))]
    return [tokenizer.encode(texts[i // samples], add_special_tokens=False) for i in range(n)]


def shape_name(n: int, group: int) -> str:
    if group >= n:
        return "one batched /generate"
    return f"{n // group} concurrent batched calls of {group}" if group > 1 else f"{n} concurrent single calls"


async def measure(servers: list[tuple[str, int]], sizes: list[int], max_new: int, repeats: int,
                  return_logprob: bool = False, prompt_source=None, group_size: int | None = None) -> list[list[dict]]:
    """Rows per server (url, pid); within one repeat every server runs each shape, the order of the servers
    alternating between repeats, so load drift hits them alike. `prompt_source(n)`: real prompts, decoded to EOS
    (None: synthetic ones, EOS ignored)."""
    params = {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": prompt_source is None}
    rows: list[list[dict]] = [[] for _ in servers]
    # Idle connections close after 1 s, before uvicorn's 5 s keep-alive timeout can close one under a new request.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=1.0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for url, pid in servers:
            await one_run(session, url, pid, [[5, 6, 7]] * 2, params, 2, return_logprob)  # warm-up
        for n in sizes:
            prompts = prompt_source(n) if prompt_source else [[5 + (i * 7 + j) % 40 for j in range(12)]
                                                              for i in range(n)]
            groups = [n] + ([group_size] if group_size and 1 < group_size < n else []) + [1]
            runs = [{g: [] for g in groups} for _ in servers]
            for r in range(repeats):
                order = list(enumerate(servers))
                for k, (url, pid) in order if r % 2 == 0 else order[::-1]:
                    for g in groups:
                        runs[k][g].append(await one_run(session, url, pid, prompts, params, g, return_logprob))
            for k in range(len(servers)):
                for g, rs in runs[k].items():
                    wall = statistics.median(r[0] for r in rs)
                    spent = statistics.median(r[1] for r in rs)
                    tokens = statistics.median(r[2] for r in rs)
                    rows[k].append({"shape": shape_name(n, g),
                                    "n": n, "wall_s": wall, "wall_mean_s": statistics.fmean(r[0] for r in rs),
                                    "engine_s": spent, "outside": 1 - spent / wall,
                                    "tokens_per_s": tokens / wall,
                                    "front_cpu_ms": 1e3 * statistics.median(r[3] for r in rs) / n})
            print(to_markdown(rows[0][-len(groups):]), flush=True)
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = ["| requests | shape | wall s | engine step s | share outside the engine | tokens/s | "
             "front-end CPU ms / request |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['shape']} | {r['wall_s']:.3f} | {r['engine_s']:.3f} | {r['outside']:.0%} | "
                     f"{r['tokens_per_s']:.0f} | {r['front_cpu_ms']:.2f} |")
    return "\n".join(lines)


def server_process(model: str, max_running: int, log_dir: Path, baseline_path: str | None = None,
                   server_flags: tuple[str, ...] = (), log_name: str | None = None):
    """`python -m slime_spec.engine` (its slime_spec imported from `baseline_path` if given, ahead of the working
    directory that `-m` puts first on sys.path)."""
    import sys

    from slime_spec.common.net import free_port
    from slime_spec.fleet.process import ServerProcess, embedded_server_process
    flags = ["--max-running-requests", str(max_running), "--skip-server-warmup", *server_flags]
    if baseline_path is None:
        return embedded_server_process(model, flags, log_path=log_dir / (log_name or "server.log"))
    port = free_port()
    run = (f"import runpy, sys; sys.path.insert(0, {baseline_path!r}); "
           "runpy.run_module('slime_spec.engine', run_name='__main__', alter_sys=True)")
    return ServerProcess([sys.executable, "-c", run, "--model-path", model, "--host", "127.0.0.1", "--port",
                          str(port), *flags], host="127.0.0.1", port=port,
                         log_path=log_dir / (log_name or "baseline.log"),
                         expect_model_path=model)


def side_by_side(rows: list[dict], base: list[dict], label: str, base_label: str) -> str:
    lines = [f"| requests | shape | {label} wall s | {base_label} wall s | {label} / {base_label} | the same, mean "
             f"wall (pauses the median hides) | share outside the engine, {label} | {base_label} | front-end CPU ms "
             f"/ request, {label} |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r, b in zip(rows, base):
        lines.append(f"| {r['n']} | {r['shape']} | {r['wall_s']:.3f} | {b['wall_s']:.3f} | "
                     f"{r['wall_s'] / b['wall_s']:.2f} | {r['wall_mean_s'] / b['wall_mean_s']:.2f} | "
                     f"{r['outside']:.0%} | {b['outside']:.0%} | {r['front_cpu_ms']:.2f} |")
    return "\n".join(lines)


def speedups(spec: list[list[dict]], plain: list[list[dict]], labels: list[str]) -> str:
    """spec_speedup per shape for each variant (its plain wall over its speculative wall), with the first
    variant's plain and speculative walls over each other variant's."""
    head = ["| requests | shape |"] + [f" {v} spec_speedup |" for v in labels]
    head += [f" {labels[0]} / {v} wall, plain / spec |" for v in labels[1:]]
    lines = ["".join(head), "| ---: | --- |" + " ---: |" * (2 * len(labels) - 1)]
    for i, r in enumerate(spec[0]):
        line = f"| {r['n']} | {r['shape']} |"
        line += "".join(f" {plain[k][i]['wall_s'] / spec[k][i]['wall_s']:.3f} |" for k in range(len(labels)))
        line += "".join(f" {plain[0][i]['wall_s'] / plain[k][i]['wall_s']:.2f} / "
                        f"{spec[0][i]['wall_s'] / spec[k][i]['wall_s']:.2f} |" for k in range(1, len(labels)))
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 and 32 requests, 32 new tokens, one repeat")
    p.add_argument("--model", default=None, help="a checkpoint directory (default: a random demo-shaped MiMo)")
    p.add_argument("--requests", default=None, help="comma-separated request counts (default 8,32,128)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (--quick 32)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved runs per row (default 3, --quick 1)")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--server-flags", default="", help="SGLang flags added to every server, e.g. the demo's "
                   "\"--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 "
                   "--speculative-num-draft-tokens 4\"")
    p.add_argument("--return-logprob", action="store_true", help="ask for the output logprobs (as the rollout does)")
    p.add_argument("--plain-twins", action="store_true", help="with speculative --server-flags: also a plain server "
                   "beside each one, all timed in turn, and spec_speedup (plain wall / speculative wall) per server")
    p.add_argument("--baseline-pythonpath", default=None,
                   help="also measure the server whose slime_spec is imported from this directory, side by side")
    p.add_argument("--prompt-data", default=None, help="a JSONL file with a \"prompt\" field (e.g. the demo's "
                   "outputs/demo/data/train.jsonl): its prompts, 8 samples each, decoded to EOS as a rollout does")
    p.add_argument("--group-size", type=int, default=None, help="also send the prompts this many at a time as "
                   "concurrent batched calls, as the rollout sends a GRPO group (e.g. 8: --n-samples-per-prompt)")
    p.add_argument("--limits", default=None, help="comma-separated --max-running-requests values: one server (and "
                   "plain twin) per value, side by side, e.g. 32,128 (a rollout in waves against one at once)")
    a = p.parse_args(argv)
    if a.limits and a.baseline_pythonpath:
        p.error("--limits and --baseline-pythonpath each set the servers compared: give one of them")
    if a.plain_twins and "--speculative-algorithm" not in a.server_flags:
        p.error("--plain-twins compares plain with speculative servers: give --server-flags with "
                "--speculative-algorithm ...")
    sizes = [int(x) for x in (a.requests or ("8,32" if a.quick else "8,32,128")).split(",")]
    max_new = a.max_new_tokens or (32 if a.quick else 64)
    repeats = a.repeats or (1 if a.quick else 3)
    model = a.model or str(make_tiny_model(Path(tempfile.mkdtemp(prefix="bench_http_")) / "mimo", arch="mimo",
                                           hidden_size=128, num_layers=6, intermediate_size=384, num_heads=4,
                                           num_kv_heads=2, max_position_embeddings=512))
    log_dir = Path(tempfile.mkdtemp(prefix="bench_http_logs_"))
    flags = tuple(a.server_flags.split())
    # variants compared side by side: (label, slime_spec from, --max-running-requests)
    variants = [("current", None, max(sizes))]
    if a.baseline_pythonpath:
        variants.append(("baseline", a.baseline_pythonpath, max(sizes)))
    if a.limits:
        variants = [(f"limit {n}", None, int(n)) for n in a.limits.split(",")]
    labels = [v[0] for v in variants]
    servers = [server_process(model, limit, log_dir, path, flags, f"server{k}.log")
               for k, (_, path, limit) in enumerate(variants)]
    if a.plain_twins:  # servers: [each variant, then each variant's plain twin]
        plain_flags = tuple(without_speculative_flags(flags))
        servers += [server_process(model, limit, log_dir, path, plain_flags, log_name=f"plain{k}.log")
                    for k, (_, path, limit) in enumerate(variants)]
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready(600)
        source = (lambda n: rollout_prompts(a.prompt_data, model, n)) if a.prompt_data else None
        rows = asyncio.run(measure([(s.url, s.pid) for s in servers], sizes, max_new, repeats, a.return_logprob,
                                   source, a.group_size))
    finally:
        for server in servers:
            server.stop()
    what = f"the prompts of {a.prompt_data} (8 samples each) to EOS or" if a.prompt_data else "synthetic prompts,"
    table = (f"Embedded server, per-request cost: {model}, {what} temperature 1, {max_new} new tokens per request"
             f"{', logprobs' if a.return_logprob else ''}{', flags ' + a.server_flags if flags else ''}, "
             f"median of {repeats} interleaved runs.\n\n" + to_markdown(rows[0]))
    for k in range(1, len(variants)):
        table += (f"\n\n{labels[k]} against {labels[0]} ({variants[k][1] or 'this checkout'}), all serving at once, "
                  f"runs alternating between them:\n\n" + side_by_side(rows[k], rows[0], labels[k], labels[0]))
    if a.plain_twins:
        n = len(variants)
        table += ("\n\nspec_speedup (plain wall / speculative wall), each plain twin timed in turn with the others:\n\n"
                  + speedups(rows[:n], rows[n:], labels))
    publish(table, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
