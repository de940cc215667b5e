"""An engine lost at any phase of a training run: the run finishes every step, trains on no stale sample, and
leaves no process behind.

One `python -m slime_spec.train` run (2 embedded engines on CPU, tiny MiMo, MTP training, NEXTN rollout), one
fault per step, injected by tests/helpers/engine_faults.py (a test double for a crash or a hang):
step 1 SIGKILL mid-rollout, 2 between the rollout and the sync, 3 mid-train, 4 mid-sync, 5 mid-eval, 6 a hang
(SIGSTOP) between the rollout and the sync. The run is shared; each phase is its own test. Step 1 is the case
of an engine killed mid-rollout of a training run: every sample of that rollout resubmitted, none lost.
"""

import json
import os
import subprocess
import sys
import uuid

import psutil
import pytest

from slime_spec.rollout.debug_data import load_rollout
from slime_spec.rollout.sample import Status
from slime_spec.tools.tiny_model import make_tiny_model
from tests.e2e.run_processes import REPO, RUN_MARKER, wait_gone
from tests.helpers import engine_faults as faults

# Per commit: an engine killed mid-rollout (tests/test_rollout_manager.py), restarted and resynced
# (tests/test_engines_fleet.py), a failed or broken sync (tests/test_weight_sync_engine.py,
# tests/test_weight_sync_broken_group.py). This whole run, each fault at its phase of a training run, is nightly.
pytestmark = pytest.mark.nightly(
    covered_by="tests/test_rollout_manager.py::test_killed_engine_is_restarted_and_nothing_is_lost")
BATCH, N, EVAL_PROMPTS = 2, 2, 2
PHASE_STEP = {"mid_rollout": 1, "after_rollout": 2, "mid_train": 3, "mid_sync": 4, "mid_eval": 5, "hang": 6}
STEPS = 7
EVAL_INTERVAL = 3  # evals: the baseline, after rollouts 2 and 5
PLAN = {
    "mid_rollout": {"rollout_id": 1, "sample_index": 1},
    "after_rollout": {"rollout_id": 2, "engine": 1},
    "mid_train": {"rollout_id": 3, "engine": 0},
    "mid_sync": {"rollout_id": 4, "engine": 1},
    "mid_eval": {"eval_call": 2 * EVAL_PROMPTS + 2},  # the second request of the eval after rollout 5
    "hang": {"rollout_id": 6, "engine": 0},
}
HEALTH_CHECK_TIMEOUT_S = "10"  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT: bounds the hang's detection (20 s)
SPEC = ["--sglang-speculative-algorithm", "NEXTN", "--sglang-speculative-num-steps", "2",
        "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "3"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model = make_tiny_model(root / "model", arch="mimo", mtp_layers=1, hidden_size=32, num_layers=1,
                            intermediate_size=64, max_position_embeddings=128, seed=3)
    data, evals = root / "prompts.jsonl", root / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(16)))
    evals.write_text("".join(json.dumps({"prompt": f"{faults.EVAL_MARK}{a}+1=", "label": str(a + 1)}) + "\n"
                             for a in range(EVAL_PROMPTS)))
    out, saved, fault_log = root / "out", str(root / "rollouts" / "rollout_{rollout_id}.pt"), root / "faults.jsonl"
    argv = [sys.executable, "-m", "slime_spec.train", "--hf-checkpoint", str(model), "--rollout-backend", "embedded",
            "--rollout-num-engines", "2", "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
            "--rm-type", "exact_match", "--rollout-skip-special-tokens", "--num-rollout", str(STEPS),
            "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N), "--rollout-max-response-len", "4",
            "--global-batch-size", str(BATCH * N), "--micro-batch-size", "2", "--lr", "1e-3",
            "--mtp-num-layers", "1", "--enable-mtp-training", *SPEC,
            "--eval-prompt-data", str(evals), "--eval-interval", str(EVAL_INTERVAL),
            "--n-samples-per-eval-prompt", "1", "--save-debug-rollout-data", saved,
            "--custom-generate-function-path", "tests.helpers.engine_faults.generate", "--output-dir", str(out)]
    tag = f"faults-{uuid.uuid4().hex[:8]}"  # every process of the run inherits it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    site = faults.write_sitecustomize(root / "site")
    env.update({RUN_MARKER: tag, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]),
                faults.FAULT_PLAN_ENV: json.dumps(PLAN), faults.FAULT_LOG_ENV: str(fault_log),
                faults.COMMANDS_ENV: str(out / "engine_logs" / "engine_commands.txt"),
                "SGLANG_HEALTH_CHECK_TIMEOUT": HEALTH_CHECK_TIMEOUT_S})
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=root)
    log = proc.stdout + proc.stderr
    (root / "driver.log").write_text(log)
    left, _ = wait_gone(tag, timeout_s=30)  # Ray's own processes stop within seconds of the driver's exit
    metrics = out / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    fired = [json.loads(x) for x in fault_log.read_text().splitlines()] if fault_log.exists() else []
    return proc, log, steps, {f["phase"]: f for f in fired}, saved, left


def test_the_run_finishes_every_step_and_leaves_no_process(run):
    proc, log, steps, fired, saved, left = run
    assert proc.returncode == 0, log[-6000:]
    assert sorted(fired) == sorted(PLAN), log[-4000:]
    assert [m["rollout_id"] for m in steps] == list(range(STEPS))
    assert all("loss" in m and m["stale_samples"] == 0 for m in steps), steps
    assert steps[0]["engine_restarts"] == 0  # before the first fault
    assert left == []  # no engine server (restarted ones included), Ray process or worker of the run
    # no stale sample trained on: every sample kept for training was generated with the policy's weights then
    for rollout_id in range(STEPS):
        version = "default" if rollout_id == 0 else str(rollout_id - 1)
        kept = [s for s in load_rollout(saved, rollout_id) if s.status != Status.ABORTED]
        assert len(kept) == BATCH * N, rollout_id
        assert {s.weight_version for s in kept} == {version}, [(s.engine_index, s.weight_version) for s in kept]


@pytest.mark.parametrize("phase", list(PHASE_STEP))
def test_an_engine_lost_in_this_phase_is_restarted_and_resynced_before_it_serves(run, phase):
    proc, log, steps, fired, saved, left = run
    assert proc.returncode == 0, log[-6000:]
    assert phase in fired, log[-4000:]
    assert not psutil.pid_exists(fired[phase]["pid"]) or \
        psutil.Process(fired[phase]["pid"]).status() == psutil.STATUS_ZOMBIE
    step = steps[PHASE_STEP[phase]]
    if phase == "mid_rollout":  # its requests failed, were resubmitted, and it was re-synced during the rollout
        assert step["engine_restarts"] == 1 and step["resync/weight_sync_params"] > 0
        assert steps[PHASE_STEP[phase] + 1]["engine_restarts"] == 0  # counted once, in the step it happened
        samples = load_rollout(saved, PHASE_STEP[phase])
        assert len(samples) == BATCH * N and all(s.status != Status.ABORTED for s in samples), \
            [(s.index, s.status, s.error) for s in samples]
    elif phase == "mid_sync":  # the sync ran again, in full, with the restarted engine in the group (the other
        # engine, left waiting in the broken collective, may be found stuck and restarted too)
        assert step["weight_sync_attempts"] == 2 and step["weight_sync_engines_restarted"] >= 1
    elif phase == "mid_eval":  # restarted by the failed request, re-synced before it served again
        assert step["eval_resync/weight_sync_params"] > 0
    else:  # found by the liveness check before the sync, restarted, then synced with the others
        assert step["weight_sync_engines_restarted"] == 1 and step["weight_sync_attempts"] == 1
    if phase == "hang":
        assert "/generate did not answer within 20 s (hung)" in log
    assert step["weight_sync_params"] > 0 and step["weight_sync_mtp_params"] > 0
