"""Running `python -m slime_spec.train` end to end in tests: a tiny prompt set, a reward that varies, the metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.ray_head import RayHead

# The reward as a user's own module (--custom-rm-path from the driver's directory), here slime_spec's tiny-run reward
DIGIT_SHARE_RM = "from slime_spec.tools.tiny_reward import digit_share  # noqa: F401\n"


def run_grpo_steps(tmp_path: Path, model: Path, extra_argv: list[str], head: RayHead | None = None,
                   steps: int = 2) -> list[dict]:
    """`steps` GRPO steps of `model` on the embedded engine (2 prompts x 4 samples, 8 response tokens), with
    `extra_argv` appended, joining `head` (None: a private Ray); asserts the run exits 0 and returns each step's
    metrics line."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(12)))
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "loop_rm.py").write_text(DIGIT_SHARE_RM)
    argv = [sys.executable, "-m", "slime_spec.train", "--hf-checkpoint", str(model), "--rollout-backend", "embedded",
            "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
            "--custom-rm-path", "loop_rm.digit_share", "--num-rollout", str(steps), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8", "--global-batch-size", "8",
            "--micro-batch-size", "4", "--lr", "1e-3", "--output-dir", str(tmp_path / "out"), *extra_argv]
    env = head.driver_env(dict(os.environ)) if head else {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path / "rm"), env.get("PYTHONPATH")) if p)
    # and the reward's directory is the driver's working directory: Ray puts that, not PYTHONPATH, on the path of a
    # joined cluster's workers
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=420, env=env, cwd=tmp_path / "rm")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in metrics] == list(range(steps))
    return metrics
