"""A run's integrity through its real command line: a reward that returns NaN, inf or raises for some samples
leaves them out (counted), and no non-finite value reaches a checkpoint or an engine (every sync read back
with --check-weight-sync); a --load that does not exist beside a --save holding checkpoints is refused before
anything starts and leaves that directory as it was; --load X --save X resumes, saying what it loaded."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.e2e.run_processes import REPO, make_run_inputs

# Rollout batch 2 x 2 samples: sample 0 scored, 1 NaN, 2 inf, 3 raises (group 1 has no usable reward at all).
REWARD = """
def reward(sample):
    if sample.index == 3:
        raise RuntimeError("grader crashed")
    return [1.0, float("nan"), float("inf"), 0.0][sample.index]
"""


def train(tmp_path, model, data, *extra: str, head, timeout: int = 420) -> subprocess.CompletedProcess:
    """A run joining `head`; the reward module is in `tmp_path`, the driver's working directory (which Ray puts on
    the path of a joined cluster's workers)."""
    argv = [sys.executable, "-m", "slime_spec.train", "--hf-checkpoint", str(model), "--rollout-backend", "embedded",
            "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
            "--custom-rm-path", "bad_reward.reward", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-2",
            "--check-weight-sync", "--weight-sync-check-interval", "1", *extra]
    env = head.driver_env(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tmp_path)])
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


def digest(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def all_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from all_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from all_tensors(v)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, ray_head):
    """One step with the bad rewards, --load and --save the same (empty) directory."""
    root = tmp_path_factory.mktemp("integrity")
    model, data = make_run_inputs(root)
    (root / "bad_reward.py").write_text(textwrap.dedent(REWARD))
    ckpt, out = root / "ckpt", root / "out"
    proc = train(root, model, data, "--num-rollout", "1", "--load", str(ckpt), "--save", str(ckpt),
                 "--save-interval", "1", "--output-dir", str(out), head=ray_head)
    return root, model, data, ckpt, out, proc


def test_bad_rewards_never_reach_weights_engines_or_checkpoints(first_run, ray_head):
    root, model, data, ckpt, out, proc = first_run
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert f"starting fresh from --hf-checkpoint: --load {ckpt} does not exist (--load and --save are the same " \
           "directory: its first run)" in proc.stdout, log
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in steps] == [0], log
    m = steps[0]
    assert m["reward_failures"] == 3 and m["reward_failures_nonfinite"] == 2 and m["reward_failures_error"] == 1
    assert m["reward_left_out"] == 3 and m["skipped_steps"] == 0 and m["reward_mean"] == 1.0
    assert m["weight_sync_checked"] == 1  # every served tensor read back equal to the (finite) one sent
    assert "have no usable reward and are left out of training; first: reward of sample 1: returned nan" in log
    shard = torch.load(ckpt / "iter_0000000" / "tp_rank_00.pt", weights_only=False)
    assert all(bool(torch.isfinite(t).all()) for t in all_tensors(shard) if t.is_floating_point())
    assert json.loads((ckpt / "iter_0000000" / "data_position.json").read_text())["consumed"] == 2
    assert list(root.glob("**/*.tmp")) == []
    assert not (out / ".slime_spec_run.lock").exists() and not (ckpt / ".slime_spec_run.lock").exists()

    before = digest(ckpt)
    refused = train(root, model, data, "--num-rollout", "2", "--load", str(root / "typo"), "--save", str(ckpt),
                    "--output-dir", str(root / "out2"), head=ray_head)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "CHECKPOINT_WOULD_OVERWRITE" in refused.stdout  # doctor, in training's preflight
    assert f"--load {root / 'typo'} does not exist, but --save {ckpt} holds checkpoints up to iteration 0" \
           in refused.stdout
    assert digest(ckpt) == before and not (root / "out2").exists()


@pytest.mark.nightly(
    covered_by="tests/e2e/test_integrity_nan_reward.py::test_bad_rewards_never_reach_weights_engines_or_checkpoints")
def test_resume_says_what_it_loaded_and_continues_the_data_with_another_batch_size(first_run, ray_head):
    root, model, data, ckpt, out, proc = first_run
    assert proc.returncode == 0
    resumed = train(root, model, data, "--num-rollout", "2", "--load", str(ckpt), "--save", str(ckpt),
                    "--rollout-batch-size", "1", "--global-batch-size", "2", "--output-dir", str(out), head=ray_head)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from --load {ckpt}: iteration 0 (the next rollout is 1); data position epoch 0, index 2 of " \
           "16 prompts (2 consumed; shuffle off)" in resumed.stdout
    position = json.loads((ckpt / "iter_0000001" / "data_position.json").read_text())
    assert position["consumed"] == 3  # one prompt on from where the batch-size-2 run stopped
    shard = torch.load(ckpt / "iter_0000001" / "tp_rank_00.pt", weights_only=False)
    assert all(bool(torch.isfinite(t).all()) for t in all_tensors(shard) if t.is_floating_point())
