"""The whole loop for each model family on one GPU: two GRPO steps of a tiny stand-in, colocated.

For each family a tiny checkpoint in its real HF layout (`make_tiny_model`: DeepSeek-V3 in its block-wise FP8 release
format, GLM-4.5, GLM-4.7-Flash, Qwen3-MoE, Qwen3) runs `python -m slime_spec.train` on one GPU as the colocated GPU
demo runs (`--colocate`, the trainer in bfloat16 with float32 master weights, the memory saver where installed):
speculative rollout on the embedded engine (NEXTN over the MTP layer, trained online, where the family has one;
NGRAM otherwise), a weight sync per step with `--check-weight-sync` (the engine's checksums of every target and MTP
tensor against the trainer's), the engine's log-probs beside the trainer's. One line per family: exit status, steps,
the sync checked, trainer-engine log-prob difference, accept length, sync seconds.

    python bench/family_loop_gpu.py                                  # every family
    python bench/family_loop_gpu.py --families deepseek_v3 qwen3_moe  # some
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (make_tiny_model arguments, whether the family has an MTP layer the rollout drafts with)
FAMILIES = {
    # SGLang's FP8 layers need in-features that are multiples of 128
    "deepseek_v3": (dict(hidden_size=512, intermediate_size=256, fp8=True), True),
    "glm4_moe": (dict(hidden_size=64, intermediate_size=128), True),
    "glm4_moe_lite": (dict(hidden_size=64, intermediate_size=128), True),
    "qwen3_moe": (dict(hidden_size=64, intermediate_size=128), False),
    "qwen3": (dict(hidden_size=64, intermediate_size=128), False),
}
MTP_SPEC = ["--mtp-num-layers", "1", "--enable-mtp-training", "--sglang-speculative-algorithm", "NEXTN",
            "--sglang-speculative-num-steps", "2", "--sglang-speculative-eagle-topk", "1",
            "--sglang-speculative-num-draft-tokens", "3"]
NGRAM_SPEC = ["--sglang-speculative-algorithm", "NGRAM", "--sglang-speculative-num-draft-tokens", "3"]


def train_argv(model: Path, data: Path, out: Path, has_mtp: bool, device: str) -> list[str]:
    """`python -m slime_spec.train` for two GRPO steps of `model`; on cuda colocated on one GPU, as the GPU demo."""
    argv = [sys.executable, "-m", "slime_spec.train", "--hf-checkpoint", str(model), "--rollout-backend", "embedded",
            "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
            "--custom-rm-path", "slime_spec.tools.tiny_reward.digit_share", "--num-rollout", "2",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16",
            "--global-batch-size", "8", "--micro-batch-size", "4", "--lr", "1e-3", "--output-dir", str(out),
            "--check-weight-sync",
            *(MTP_SPEC if has_mtp else NGRAM_SPEC)]
    if device == "cuda":
        from slime_spec.demo.run import gpu_layout_argv
        argv += gpu_layout_argv("colocate")
    return argv


def summary(family: str, returncode: int, seconds: float, steps: list[dict], tail: str) -> str:
    """One table row: what the run's metrics lines say, or why it failed."""
    if returncode != 0 or not steps:
        last = " / ".join(line for line in tail.strip().splitlines()[-3:])
        return f"| {family} | exit {returncode} | {len(steps)} | - | - | - | - | {seconds:.0f} | {last[:300]} |"
    checked = all(s.get("weight_sync_checked") == 1 for s in steps)
    diff = max((s.get("train_rollout_logprob_abs_diff", float("nan")) for s in steps), default=float("nan"))
    accept = ", ".join(f"{s.get('spec_accept_length', 0):.2f}" for s in steps)
    sync = ", ".join(f"{s.get('weight_sync_s', 0):.2f}" for s in steps)
    moved = any(s.get("grad_norm", 0) > 0 for s in steps)
    return (f"| {family} | exit 0 | {len(steps)} | {'yes' if checked else 'NO'} | {diff:.2e} | {accept} | {sync} "
            f"| {seconds:.0f} | {'policy moved' if moved else 'no gradient'} |")


def run_family(family: str, root: Path, device: str, timeout_s: float) -> str:
    from slime_spec.tools.tiny_model import make_tiny_model

    shape, has_mtp = FAMILIES[family]
    work = root / family
    model = make_tiny_model(work / "model", arch=family, mtp_layers=1 if has_mtp else 0, num_layers=2,
                            max_position_embeddings=1024, first_k_dense_replace=1, dtype="bfloat16", seed=3,
                            **shape)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(8)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(train_argv(model, data, work / "out", has_mtp, device), env=env, capture_output=True,
                              text=True, timeout=timeout_s)
        returncode, tail = done.returncode, done.stdout[-4000:] + done.stderr[-4000:]
    except subprocess.TimeoutExpired as e:
        returncode, tail = -1, f"timed out after {timeout_s:.0f} s; {(e.stdout or b'')[-2000:]!r}"
    (work / "run.log").write_text(tail)
    metrics = work / "out" / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    return summary(family, returncode, time.perf_counter() - t0, steps, tail)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per family")
    p.add_argument("--work-dir", type=Path, default=None, help="default: a new temporary directory")
    a = p.parse_args(argv)
    root = a.work_dir or Path(tempfile.mkdtemp(prefix="family_loop_"))
    print(f"two GRPO steps per family on {a.device}; logs under {root}", flush=True)
    rows = []
    for family in a.families:
        rows.append(run_family(family, root, a.device, a.timeout_s))
        print(rows[-1], flush=True)
    print("| family | run | steps | sync checked | trainer-engine log-prob diff (mean abs, worst step) "
          "| accept length per step | sync s per step | wall s | |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0 if all("| exit 0 |" in r and "| yes |" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
