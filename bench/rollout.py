"""Rollout overhead: the RolloutManager (Ray actor, routing, retries, metrics) vs raw HTTP to the same engine.

Both paths send the same /generate requests (same prompt ids, greedy sampling, same max_new_tokens)
to the same engine server at the same concurrency, in one run, alternating paths per repeat. The
manager path is timed from the driver (`ray.get(manager.generate.remote(i))`), so it includes the
Ray call, sample bookkeeping, rewards and metrics; "inside the actor" is the manager's own
`rollout_time_s` (requests, retries bookkeeping and rewards, without the Ray call and metrics).

    .venv/bin/python bench/rollout.py [--model-path DIR] [--num-samples 64] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import ray

from slime_spec.config.run_config import EngineConfig, RolloutConfig
from slime_spec.rollout.data import PromptDataset
from slime_spec.rollout.manager import RolloutManagerActor
from slime_spec.rollout.sampling_params import sampling_params


def write_prompts(path: Path, n: int) -> None:
    path.write_text("\n".join(json.dumps({"input": f"question {i}: what is {i} + {i}? answer:", "label": str(2 * i)})
                              for i in range(n)) + "\n")


async def direct_http(url: str, payloads: list[dict], concurrency: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(session, payload):
        nonlocal tokens
        async with sem:
            async with session.post(f"{url}/generate", json=payload) as r:
                r.raise_for_status()
                out = await r.json()
        tokens += out["meta_info"]["completion_tokens"]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        await asyncio.gather(*[one(session, p) for p in payloads])
        return time.perf_counter() - start, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="HF checkpoint; default: a tiny llama built in a temp dir")
    p.add_argument("--engine-argv", default="--speculative-algorithm NGRAM", help="forwarded SGLang flags")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    model = args.model_path
    if model is None:
        from slime_spec.tools.tiny_model import make_tiny_model
        model = str(make_tiny_model(work / "llama", arch="llama"))
    write_prompts(work / "prompts.jsonl", args.num_samples)
    rollout = RolloutConfig(hf_checkpoint=model, prompt_data=str(work / "prompts.jsonl"), label_key="label",
                            rm_type="math", rollout_batch_size=args.num_samples, n_samples_per_prompt=1,
                            rollout_max_response_len=args.max_new_tokens, rollout_temperature=0.0,
                            sglang_server_concurrency=args.concurrency)
    engine = EngineConfig(backend="embedded", model_path=model, forwarded_argv=tuple(args.engine_argv.split()))

    ray.init(address="local", include_dashboard=False)  # its own cluster: a fair, quiet measurement
    manager = RolloutManagerActor.options(num_cpus=0).remote(rollout, engine, 1, log_dir=str(work / "logs"),
                                                             show_progress=False)
    try:
        url = ray.get(manager.engine_urls.remote())[0]
        from transformers import AutoTokenizer

        ds = PromptDataset(rollout.prompt_data, AutoTokenizer.from_pretrained(model), label_key="label")
        params = sampling_params(rollout)
        payloads = [{"input_ids": s.tokens, "sampling_params": dict(params), "return_logprob": True}
                    for s in ds.batch(0, args.num_samples, 1)]
        ray.get(manager.generate.remote(0))  # warm-up: engine caches, connections, imports
        asyncio.run(direct_http(url, payloads, args.concurrency))
        results = {"manager": [], "manager (inside the actor)": [], "direct": []}
        for r in range(args.repeats):
            start = time.perf_counter()
            samples = ray.get(manager.generate.remote(0))  # rollout 0 again: the same prompts as `payloads`
            tokens = sum(s.response_length for s in samples)
            results["manager"].append((time.perf_counter() - start, tokens))
            results["manager (inside the actor)"].append(
                (ray.get(manager.get_last_metrics.remote())["rollout_time_s"], tokens))
            results["direct"].append(asyncio.run(direct_http(url, payloads, args.concurrency)))
    finally:
        ray.get(manager.shutdown.remote())
        ray.shutdown()

    print(f"\nrollout overhead: {args.num_samples} samples x {args.max_new_tokens} max new tokens, "
          f"concurrency {args.concurrency}, engine `{args.engine_argv}`, {args.repeats} repeats "
          "(samples/s and tokens/s from the median time)\n")
    print("| path | median time (s) | min time (s) | samples/s | tokens/s | tokens |\n"
          "| --- | --- | --- | --- | --- | --- |")
    med = {}
    for path, runs in results.items():
        t = statistics.median(x[0] for x in runs)
        tokens = runs[0][1]
        med[path] = (t, tokens)
        print(f"| {path} | {t:.3f} | {min(x[0] for x in runs):.3f} | {args.num_samples / t:.1f} | {tokens / t:.1f} "
              f"| {tokens} |")
    if med["manager"][1] != med["direct"][1]:
        print(f"warning: the paths generated different token counts ({med['manager'][1]} vs {med['direct'][1]})")
    print(f"\noverhead ratio (manager time / direct time): {med['manager'][0] / med['direct'][0]:.3f}")


if __name__ == "__main__":
    main()
