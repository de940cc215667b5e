"""The demo's SFT warm-up in float32 and in bfloat16 (`--bf16`, float32 master weights), side by side in one run:
seconds per step, and the loss the same steps on the same batches reach.

Why: the SFT is the demo's largest stage on a 2-core CPU, and CPUs with native bfloat16 matmuls (AVX512-BF16,
AMX) multiply bfloat16 faster than float32; the demo takes `--bf16` for its SFT there (demo.native_bf16) only if it
costs no quality. Both rows train the demo's model from the same initial weights on the same sequence of batches
(the demo's seed and sampler), in this process (one trainer, no Ray); the timed steps of the two precisions are
interleaved, a block of steps each in turn, so a change in the machine's load falls on both.

    python bench/demo_sft.py                  # the demo's size: 200 steps of 32 problems each (about 6 min)
    python bench/demo_sft.py --quick          # the smoke size, 20 steps
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

PRECISIONS = {"float32": False, "bfloat16": True}  # name: --bf16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the demo's smoke size")
    p.add_argument("--steps", type=int, default=None, help="SFT steps per precision (default: the demo's)")
    p.add_argument("--block", type=int, default=10, help="steps of one precision before the other's turn")
    p.add_argument("--tail", type=int, default=15, help="the loss reported is the mean over the last N steps")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_trainer(model: Path, size: dict, seed: int, bf16: bool, out: str):
    """A trainer with the demo's SFT flags (demo.sft_argv), in this process."""
    import torch

    from slime_spec.config.args import parse_config
    from slime_spec.demo import run as demo
    from slime_spec.trainer.trainer import Trainer
    config, _ = parse_config(demo.sft_argv(model, size, seed, Path(out), bf16=bf16))
    torch.manual_seed(seed)
    return Trainer(config.train)


def table(rows: list[tuple[str, list[float], list[float], list[float]]], tail: int) -> str:
    """Markdown: median seconds per step, loss and MTP loss over the last `tail` steps, and speed vs float32."""
    base = statistics.median(rows[0][1])
    lines = ["| precision | s/step (median) | vs float32 | loss (last %d steps) | MTP loss (last %d steps) |"
             % (tail, tail), "| --- | ---: | ---: | ---: | ---: |"]
    for name, secs, loss, mtp in rows:
        s = statistics.median(secs)
        lines.append(f"| {name} | {s:.3f} | {base / s:.2f}x | {statistics.fmean(loss[-tail:]):.4f} | "
                     f"{statistics.fmean(mtp[-tail:]):.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    from transformers import AutoTokenizer

    from slime_spec.common.logging_setup import quiet_known_noise
    from slime_spec.demo import run as demo
    from slime_spec.trainer import parallel
    quiet_known_noise()
    size = demo.SIZES["smoke" if a.quick else "full"]
    steps = a.steps or size["sft_steps"]
    parallel.init_single_process(seed=a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model, _, _, rows = demo.make_model_and_data(Path(tmp), size, a.seed)
        samples = demo.sft_samples(rows, AutoTokenizer.from_pretrained(model))
        runs = {name: dict(trainer=make_trainer(model, size, a.seed, bf16, tmp), rng=random.Random(a.seed),
                           secs=[], loss=[], mtp=[]) for name, bf16 in PRECISIONS.items()}
        print(f"[demo_sft] {steps} steps of {size['sft_batch']} problems per precision, blocks of {a.block}; native "
              f"bfloat16 matmuls on this CPU: {demo.native_bf16()}", flush=True)
        for start in range(0, steps, a.block):
            for name, run in runs.items():
                for step in range(start, min(steps, start + a.block)):
                    batch = run["rng"].sample(samples, size["sft_batch"])
                    t0 = time.perf_counter()
                    m = run["trainer"].train_step(batch, step)
                    run["secs"].append(time.perf_counter() - t0)
                    run["loss"].append(m["loss"])
                    run["mtp"].append(m.get("mtp_loss", 0.0))
            done = min(steps, start + a.block)
            print(f"  step {done}/{steps}: " + ", ".join(
                f"{name} loss {run['loss'][-1]:.3f}" for name, run in runs.items()), flush=True)
    print(table([(name, run["secs"][1:], run["loss"], run["mtp"]) for name, run in runs.items()],
                min(a.tail, steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
