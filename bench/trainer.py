"""Trainer throughput, side by side in one run: packed vs padded micro-batches on long-tailed lengths, and
the step-time cost of online MTP training (no MTP layer / MTP forward only / --enable-mtp-training), split
into the parts of a step (trainer/timing.py) and extrapolated to the model's full depth.

Each row is a real GRPO `Trainer.train_step` (old-policy log-probs, forward, backward, AdamW) on the same
random MiMo-shaped checkpoint and the same samples. Lengths: a prompt plus a log-normal response whose
99th percentile is 10x its median, cut at --max-len. Padded micro-batches hold as many samples as fit the
same token budget when padded to the longest (--max-tokens-per-gpu / --max-len), as a padded trainer
must size them; packed ones fill the budget with real tokens.

Full depth: the MTP layer's cost does not grow with the trunk's depth, the trunk's does. The no-MTP step
is also timed at half the layers; the slope gives the cost per trunk layer and the step at
--full-depth-layers is extrapolated from it (MiMo-7B-RL: 36), the MTP overhead divided by that.

    python bench/trainer.py --quick                                  # CPU, tiny shapes, float32
    python bench/trainer.py --device cuda --dtype bf16               # MiMo-7B-RL layer shapes, 4 of 36 layers
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

MIMO_7B = dict(hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=8, vocab_size=151680)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU-sized shapes and lengths (overrides the size flags)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="bf16 = --bf16 (float32 masters)")
    p.add_argument("--hidden-size", type=int, default=MIMO_7B["hidden_size"])
    p.add_argument("--intermediate-size", type=int, default=MIMO_7B["intermediate_size"])
    p.add_argument("--num-heads", type=int, default=MIMO_7B["num_heads"])
    p.add_argument("--num-kv-heads", type=int, default=MIMO_7B["num_kv_heads"])
    p.add_argument("--vocab-size", type=int, default=MIMO_7B["vocab_size"])
    p.add_argument("--num-layers", type=int, default=4, help="MiMo-7B-RL has 36; keep what fits in memory")
    p.add_argument("--full-depth-layers", type=int, default=36,
                   help="extrapolate the MTP overhead to this many trunk layers (MiMo-7B-RL: 36)")
    p.add_argument("--samples", type=int, default=32, help="samples per step (= --global-batch-size)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--median-response-len", type=int, default=192)
    p.add_argument("--max-len", type=int, default=2048, help="prompt + response cut (the longest sample)")
    p.add_argument("--max-tokens-per-gpu", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (after one warm-up step)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.quick:
        a.device, a.dtype = "cpu", "fp32"
        a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads, a.vocab_size = 128, 256, 4, 2, 512
        a.num_layers, a.samples, a.prompt_len, a.median_response_len = 2, 16, 8, 24
        a.full_depth_layers = 8
        a.max_len, a.max_tokens_per_gpu, a.steps = 256, 512, 2
    if a.max_len > a.max_tokens_per_gpu:
        p.error(f"--max-len {a.max_len} must be at most --max-tokens-per-gpu {a.max_tokens_per_gpu}")
    if a.num_layers < 2:
        p.error("--num-layers must be at least 2 (the per-layer cost is measured at half the layers too)")
    if a.samples % 2:
        p.error("--samples must be even (GRPO groups of 2)")
    return a


def sample_lengths(a, rng) -> list[int]:
    """prompt + log-normal response (p99 = 10 x median), cut at --max-len."""
    sigma = math.log(10.0) / 2.326
    return [min(a.max_len, a.prompt_len + max(1, round(rng.lognormvariate(math.log(a.median_response_len), sigma))))
            for _ in range(a.samples)]


def make_samples(lengths: list[int], a, rng):
    from slime_spec.rollout.sample import Sample
    out = []
    for i, n in enumerate(lengths):
        tokens = [rng.randrange(5, a.vocab_size) for _ in range(n)]
        out.append(Sample(index=i, group_index=i // 2, prompt="p", tokens=tokens, response_length=n - a.prompt_len,
                          reward=float(i % 2)))
    return out


def time_steps(train_config, samples, steps: int, split: bool = False) -> tuple[float, object, dict[str, float]]:
    """Median seconds of `steps` train_steps after one warm-up; the trainer's plan of the samples; with
    `split`, `steps` more steps with the per-part timer on (it synchronises the GPU around each part, so
    the plain steps give the step time) and the mean seconds per step of each part."""
    import torch

    from slime_spec.trainer.timing import PartTimer
    from slime_spec.trainer.trainer import Trainer
    trainer = Trainer(train_config)
    plan = trainer.plan(samples)
    trainer.train_step(samples, 0)
    times = []
    for r in range(steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step(samples, r + 1)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    parts: dict[str, float] = {}
    if split:
        trainer.timer = PartTimer(enabled=True)
        for r in range(steps):
            trainer.train_step(samples, steps + r + 1)
        parts = {part: secs / steps for part, secs in trainer.timer.seconds.items()}
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return statistics.median(times), plan, parts


def computed_tokens(plan, lengths: list[int], packed: bool) -> int:
    """Token positions the model runs: real tokens when packed, rows padded to each micro-batch's longest."""
    return sum(sum(lengths[i] for i in mb) if packed else len(mb) * max(lengths[i] for i in mb)
               for step in plan for mb in step)


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import random

    import torch

    from slime_spec.config.run_config import TrainConfig
    from slime_spec.tools.tiny_model import make_tiny_model
    from slime_spec.trainer import parallel
    from slime_spec.trainer.timing import PARTS
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here; use --device cpu (or --quick)")
    parallel.init_single_process(seed=a.seed)
    rng = random.Random(a.seed)
    lengths = sample_lengths(a, rng)
    samples = make_samples(lengths, a, rng)
    def checkpoint(tmp: str, num_layers: int):
        return make_tiny_model(tmp, arch="mimo", mtp_layers=1, vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                               num_layers=num_layers, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                               intermediate_size=a.intermediate_size,
                               max_position_embeddings=max(a.max_len, 1024), seed=a.seed,
                               dtype="bfloat16" if a.dtype == "bf16" else "float32")

    half_layers = a.num_layers // 2
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(os.path.join(tmp, "full"), a.num_layers)
        half_path = checkpoint(os.path.join(tmp, "half"), half_layers)
        padded_mbs = max(1, a.max_tokens_per_gpu // a.max_len)
        while a.samples % padded_mbs:
            padded_mbs -= 1
        base = dict(hf_checkpoint=str(path), lr=1e-6, global_batch_size=a.samples, n_samples_per_prompt=2,
                    bf16=a.dtype == "bf16", micro_batch_size=padded_mbs)
        rows = []
        real = sum(lengths)
        for name, kw, packed in (
                (f"padded ({padded_mbs} samples/micro-batch)", {}, False),
                (f"packed (<= {a.max_tokens_per_gpu} tokens/micro-batch)",
                 {"max_tokens_per_gpu": a.max_tokens_per_gpu}, True)):
            secs, plan, _ = time_steps(TrainConfig(**base, **kw), samples, a.steps)
            rows.append((name, secs, real / secs, computed_tokens(plan, lengths, packed) / real,
                         sum(len(step) for step in plan)))
        mtp_rows = []
        packed_kw = {"max_tokens_per_gpu": a.max_tokens_per_gpu}
        for name, kw in (("no MTP layer", {"mtp_num_layers": 0}),
                         ("MTP layer, forward only (frozen draft)", {"mtp_num_layers": 1}),
                         ("--enable-mtp-training", {"mtp_num_layers": 1, "enable_mtp_training": True})):
            secs, _, parts = time_steps(TrainConfig(**base, **packed_kw, **kw), samples, a.steps, split=True)
            mtp_rows.append((name, secs, parts))
        half, _, _ = time_steps(TrainConfig(**{**base, "hf_checkpoint": str(half_path)}, **packed_kw,
                                            mtp_num_layers=0), samples, a.steps)
    per_layer = (mtp_rows[0][1] - half) / (a.num_layers - half_layers)
    full_step = mtp_rows[0][1] + per_layer * (a.full_depth_layers - a.num_layers)

    device = torch.cuda.get_device_name() if a.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"\n{device}, {a.dtype}, hidden {a.hidden_size}, ffn {a.intermediate_size}, heads {a.num_heads}/"
          f"{a.num_kv_heads}, vocab {a.vocab_size}, {a.num_layers} layers + 1 MTP layer; {a.samples} samples/step, "
          f"lengths median {statistics.median(lengths):.0f}, max {max(lengths)}, mean {real / len(lengths):.0f} "
          f"tokens; median of {a.steps} GRPO steps")
    print("\n| micro-batches | step s | train tokens/s | computed / real tokens | micro-batches/step | speed-up |")
    print("|---|---|---|---|---|---|")
    for name, secs, tps, waste, n_mb in rows:
        print(f"| {name} | {secs:.3f} | {tps:,.0f} | {waste:.2f} | {n_mb} | {rows[0][1] / secs:.2f}x |")
    base_secs = mtp_rows[0][1]
    print(f"\n| packed, MTP | step s | vs no MTP layer | at {a.full_depth_layers} layers (extrapolated) |")
    print("|---|---|---|---|")
    for name, secs, _ in mtp_rows:
        print(f"| {name} | {secs:.3f} | {(secs / base_secs - 1) * 100:+.1f}% | "
              f"{(secs - base_secs) / full_step * 100:+.1f}% |")
    print(f"\nper trunk layer {per_layer:.4f} s/step (no-MTP step at {half_layers} layers: {half:.3f} s); "
          f"no-MTP step at {a.full_depth_layers} layers: {full_step:.3f} s (extrapolated)")
    print("\n| seconds per step, timed apart (GPU synchronised per part) | "
          + " | ".join(PARTS) + " |")
    print("|---|" + "---|" * len(PARTS))
    for name, _, parts in mtp_rows:
        print(f"| {name} | " + " | ".join(f"{parts[p]:.3f}" if p in parts else "-" for p in PARTS) + " |")


if __name__ == "__main__":
    main()
