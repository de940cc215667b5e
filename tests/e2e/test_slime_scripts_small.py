"""Upstream slime's dense run scripts (run-qwen3-4B.sh, run-mimo-7B-rl-eagle.sh: their argument arrays, paths
changed only) train two GRPO steps on a tiny stand-in of their model, with scripts/common.sh's SMALL_MACHINE=1
overrides, through `python -m slime_spec.train`: a slime user changes nothing but the paths."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.slime_scripts import DENSE, small_machine_argv, without_model_args

ROOT = Path(__file__).resolve().parents[2]
ARCH = {"run-qwen3-4B": "qwen3", "run-mimo-7B-rl-eagle": "mimo"}


@pytest.mark.parametrize("name", DENSE)
def test_dense_slime_script_trains_two_grpo_steps_on_a_tiny_stand_in(tmp_path, name):
    model = make_tiny_model(tmp_path / "model", arch=ARCH[name], mtp_layers=1, hidden_size=32, num_layers=1,
                            intermediate_size=64, max_position_embeddings=1024, seed=3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "WANDB_"))}
    env.update(SMALL_MACHINE="1", HF_CHECKPOINT=str(model), OUTPUT_DIR=str(tmp_path / "run"),
               CKPT_DIR=str(tmp_path / "ckpt"), EXTRA_ARGS=f"--ref-load {model}")  # the script's torch_dist path
    argv = small_machine_argv(without_model_args(name, tmp_path), env, ROOT)
    done = subprocess.run([sys.executable, "-m", "slime_spec.train", *argv], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=540)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["rollout_id"] for s in steps] == [0, 1]
    assert out.count("Started a local Ray instance") == 1 and "Token authentication" not in out
