"""How precise is one `spec_speedup` measurement on this machine? Identical engines, timed as the probe times them.

Two speculative engines that are the same (checkpoint, flags, seed) and a plain one serve the same prompts, round
after round, in rotating order, through the probe's own client (`spec_speedup.time_generation`: the rollout's sampling
params, every request at once; the driver's collector paused over the rounds). The two identical engines should run at
1.00x of each other, so the spread of that ratio is the noise of a measurement that compares two drafts; the spread of
plain time over speculative time is the noise of `spec_speedup` itself. Both are reported for one pass per engine and
for the median of R passes (`--spec-speedup-repeats R`), R consecutive rounds each. Each pass's stall, its wall
seconds less the seconds the engine spent inside steps (`engine_step_s`), shows waits outside the engine: a client
that did not send, an engine thread that could not run.

Engines start as `python -m slime_spec.engine` with `OMP_NUM_THREADS=1`, the thread count a Ray worker gives engine 0.

    python bench/speedup_noise.py --model outputs/demo/model_sft     # after `make demo`: its SFT checkpoint
    python bench/speedup_noise.py --model DIR --rounds 12 --repeats 3 --swap
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

SPEC_FLAGS = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4"]  # the demo's
ENGINES = {"spec_a": SPEC_FLAGS, "spec_b": SPEC_FLAGS, "plain": []}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="outputs/demo/model_sft",
                   help="an HF checkpoint with an MTP layer (default: the SFT checkpoint `make demo` leaves)")
    p.add_argument("--rounds", type=int, default=9, help="rounds; each times every engine once")
    p.add_argument("--repeats", type=int, default=3, help="R of the median-of-R rows (consecutive rounds)")
    p.add_argument("--prompts", type=int, default=8, help="prompts, each sampled --samples times (the demo's 8 x 8)")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--swap", action="store_true",
                   help="swap the identical engines' places in the rotation: a steady gap that follows the place, "
                        "not the engine, is the order's")
    return p.parse_args(argv)


def ratios(num: list[float], den: list[float], group: int = 1) -> list[float]:
    """median(num) / median(den) over consecutive groups of `group` rounds (a trailing partial group is dropped)."""
    n = len(num) // group * group
    return [statistics.median(num[i:i + group]) / statistics.median(den[i:i + group]) for i in range(0, n, group)]


def spread(values: list[float]) -> str:
    """min / median / max, and the largest distance from the median in percent."""
    mid = statistics.median(values)
    worst = max(abs(v / mid - 1) for v in values)
    return f"{min(values):.3f} / {mid:.3f} / {max(values):.3f} | +-{100 * worst:.0f}%"


def table(seconds: dict[str, list[float]], stalls: dict[str, list[float]], repeats: int) -> str:
    """Markdown: the identical engines' ratio and spec_speedup, per pass and per median of `repeats`; stalls."""
    lines = ["| quantity | estimate | n | min / median / max \\| worst distance from the median |",
             "| --- | --- | ---: | --- |"]
    for name, num, den in (("spec_b time / spec_a time (identical engines)", "spec_b", "spec_a"),
                           ("spec_speedup (plain time / spec_a time)", "plain", "spec_a")):
        for group in (1, repeats):
            r = ratios(seconds[num], seconds[den], group)
            if r:
                label = "one pass" if group == 1 else f"median of {group}"
                lines.append(f"| {name} | {label} | {len(r)} | {spread(r)} |")
    for name, values in stalls.items():
        lines.append(f"| stall of {name} (wall - engine steps, s) | one pass | {len(values)} | {spread(values)} |")
    return "\n".join(lines)


def prompts_for(tokenizer, n_prompts: int, samples: int, seed: int) -> list[list[int]]:
    from slime_spec.demo.task import split_problems
    rows, _ = split_problems(n_prompts, 0, seed + 1, digits=3)
    return [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows for _ in range(samples)]


def main(argv=None) -> int:
    import requests
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from slime_spec.fleet.client import EngineAuth
    from slime_spec.fleet.process import embedded_server_process
    from slime_spec.speculative.speedup import collector_paused, time_generation
    a = parse_args(argv)
    model = Path(a.model)
    if not (model / "config.json").exists():
        raise SystemExit(f"--model {model}: no HF checkpoint there; run `make demo` first (it leaves "
                         "outputs/demo/model_sft) or pass --model DIR")
    prompts = prompts_for(AutoTokenizer.from_pretrained(model), a.prompts, a.samples, a.seed)
    params = {"temperature": 1.0, "max_new_tokens": a.max_new_tokens, "skip_special_tokens": True}
    logs = Path(tempfile.mkdtemp(prefix="speedup_noise_"))
    servers = {}
    try:
        for name, flags in ENGINES.items():
            servers[name] = embedded_server_process(model, [*flags, "--random-seed", str(a.seed)],
                                                    log_path=logs / f"{name}.log", env={"OMP_NUM_THREADS": "1"})
            servers[name].launch()
        for server in servers.values():
            server.wait_ready(600)

        def engine_step_s(name: str) -> float:
            info = requests.get(servers[name].url + "/get_server_info", timeout=30).json()
            return info["internal_states"][0]["engine_step_s"]

        def timed(name: str) -> tuple[float, float]:
            before = engine_step_s(name)
            half = asyncio.run(time_generation(servers[name].url, EngineAuth(), [[p] for p in prompts], params,
                                                  len(prompts), 600))
            return half.seconds, half.seconds - (engine_step_s(name) - before)

        names = ("spec_b", "plain", "spec_a") if a.swap else ("spec_a", "plain", "spec_b")
        seconds = {name: [] for name in names}
        stalls = {name: [] for name in names}
        with collector_paused():  # as the probe times a measurement
            for name in servers:  # untimed: first-call costs
                timed(name)
            for r in tqdm(range(a.rounds), desc="rounds"):
                k = r % len(names)
                for name in names[k:] + names[:k]:
                    s, stall = timed(name)
                    seconds[name].append(s)
                    stalls[name].append(stall)
    finally:
        for server in servers.values():
            server.stop()
    print(f"\n{len(prompts)} requests a pass ({a.prompts} prompts x {a.samples}), {a.rounds} rounds in rotating order; "
          f"engine logs under {logs}")
    print(table(seconds, stalls, a.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
