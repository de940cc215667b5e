"""The whole loop through its real command line, two steps, in every mode.

`python -m slime_spec.train` in a subprocess (joining the package's Ray head, tests/helpers/ray_head.py), a tiny
MiMo checkpoint, the embedded engine with NEXTN speculation: debug-rollout-only (saving rollout data, with dynamic
sampling), debug-train-only (replaying it); separate placement runs in the demo smoke test below, colocated two steps
in tests/e2e/test_placement.py. The rollout-only run has two engines.
"""

import json
import os
import subprocess
import sys

import pytest

from slime_spec.rollout.debug_data import load_rollout
from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.rollout_checks import check_rollouts_on_two_engines

STEPS = 2
SPEC = ["--sglang-speculative-algorithm", "NEXTN", "--sglang-speculative-num-steps", "2",
        "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "3"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    model = make_tiny_model(root / "model", arch="mimo", mtp_layers=1, hidden_size=32, num_layers=1,
                            intermediate_size=64, max_position_embeddings=128, seed=3)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(12)))
    return root, model, data


def train(root, model, data, out: str, *extra: str, head, timeout=240) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "slime_spec.train", "--hf-checkpoint", str(model), "--rollout-backend", "embedded",
            "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label", "--rm-type", "exact_match",
            "--rollout-skip-special-tokens", "--num-rollout", str(STEPS), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--lr", "1e-3", "--mtp-num-layers", "1", "--enable-mtp-training",
            "--output-dir", str(root / out), *SPEC, *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=head.driver_env(dict(os.environ)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_debug_rollout_only_then_debug_train_only(setup, ray_head):
    root, model, data = setup
    saved = str(root / "rollouts" / "rollout_{rollout_id}.pt")
    # dynamic sampling as a slime script asks for it, with a filter keeping the even prompts of the 12
    proc = train(root, model, data, "rollout_only", "--debug-rollout-only", "--save-debug-rollout-data", saved,
                 "--metrics-jsonl", str(root / "rollout_only.jsonl"), "--rollout-num-engines", "2",
                 "--over-sampling-batch-size", "3",
                 "--dynamic-sampling-filter-path", "tests.helpers.rollout_checks.keep_even_prompts", head=ray_head)
    assert "debug-rollout-only: 2 rollouts, 8 samples" in proc.stdout
    # the MTP layer drafted on both engines, every count adding up to the saved samples
    rollouts = check_rollouts_on_two_engines(root / "rollout_only.jsonl", saved, STEPS, 4)
    # rollout 0 takes prompts 0-2 (1 dropped, or cut off once 0 and 2 finished); rollout 1 takes 3-5, drops 3 and 5,
    # so takes 6-8 too: it keeps 4 and the first of 6 and 8 to finish, the rest dropped or cut off
    assert [m["dynamic_sampling_prompts"] for m in rollouts] == [3, 6]
    for m in rollouts:
        assert m["dynamic_sampling_dropped"] + m["dynamic_sampling_aborted"] == m["dynamic_sampling_prompts"] - 2
        assert m["dynamic_sampling_dropped"] == m.get("dynamic_filter/drop_odd_prompt", 0)
        kept = load_rollout(saved, m["rollout_id"])
        assert all(s.metadata["prompt_index"] % 2 == 0 for s in kept)
        assert [(s.group_index, s.index) for s in kept] == [(i // 2, i) for i in range(4)]
    # no trainer ran: no loss key in the rollout-only metrics
    assert all("loss" not in m for m in rollouts)

    train(root, model, data, "train_only", "--debug-train-only", "--load-debug-rollout-data", saved, head=ray_head)
    steps = lines(root / "train_only" / "metrics.jsonl")
    assert [m["rollout_id"] for m in steps] == [0, 1]
    assert all(m["replayed_samples"] == 4 and "loss" in m and "weight_sync_s" not in m for m in steps)


def test_doctor_error_stops_training_before_launch(setup):
    root, model, data = setup
    argv = [sys.executable, "-m", "slime_spec.train", "--hf-checkpoint", str(model), "--rollout-backend", "embedded",
            "--sglang-speculative-algorithm", "EAGLE3"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "SPEC_EAGLE3_NO_DRAFT" in proc.stdout


def test_demo_smoke_writes_sane_outputs(tmp_path, ray_head):
    """`make demo SMOKE=1`: every stage of the demo at a small size, separate placement."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "slime_spec.demo", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=ray_head.driver_env(dict(os.environ)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = lines(out / "metrics.jsonl")
    assert len(steps) == 2
    for key in ("rollout_id", "num_samples", "response_tokens", "rollout_time_s", "tokens_per_s",
                "spec_accept_length", "spec_verify_ct", "reward_mean", "engine_restarts", "weight_sync_s",
                "weight_sync_gbps", "weight_sync_params", "weight_sync_mtp_params"):
        assert all(key in m for m in steps), key
    # scratchpad_concise: the scratchpad reward (0 to 1) less a length penalty of at most 0.5
    assert all(m["spec_accept_length"] >= 1.0 and -0.5 <= m["reward_mean"] <= 1.0 for m in steps)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mtp_trained"]["num_steps"] == 2
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "accept length" in proc.stdout and "reward" in proc.stdout
    # --spec-speedup-interval 2: the first step (the baseline) and the last are timed with and without speculation,
    # and with the MTP layer as SFT left it (--spec-speedup-frozen-draft)
    measured = [m for m in steps if m.get("spec_speedup") is not None]
    assert [m["rollout_id"] for m in measured] == [0, 1]
    m = measured[-1]
    assert m["spec_speedup_plain_s"] > 0 and m["spec_speedup_spec_s"] > 0 and m["spec_speedup_frozen_s"] > 0
    assert m["spec_speedup_plain_tokens"] > 0 and m["spec_speedup_accept_length"] >= 1.0
    assert m["spec_speedup_frozen_tokens"] > 0 and m["spec_speedup_frozen_accept_length"] >= 1.0
    assert m["spec_speedup_passes"] == 2  # --spec-speedup-repeats 2: every engine timed twice, its median kept
    assert summary["mtp_trained"]["spec_speedup_measurements"] == 2
    assert summary["online_draft_gain"] == pytest.approx(sum(x["spec_speedup_frozen_s"] for x in measured)
                                                         / sum(x["spec_speedup_spec_s"] for x in measured))
    assert "online draft" in proc.stdout and "median of 2 passes" in proc.stdout
    for run in ("mtp_trained", "draft_frozen"):
        assert summary["spec_speedup"][run] > 0
    assert summary["draft_frozen"]["spec_speedup_frozen"] == summary["spec_speedup"]["draft_frozen"]
    assert "(draft frozen)" in proc.stdout
    assert (out / "run" / "spec_speedup" / "frozen_engine" / "engine_0.log").exists()
    assert "spec_speedup" in proc.stdout and "did NOT rise" not in proc.stdout
    assert "smoke run: too few steps to learn" in proc.stdout
    # where the rollout's time went (engine phases, outside the engine) and accept length both ways
    # a step that drafted spent time verifying
    for m in steps:
        assert 0 < m["time_share_engine"] <= 1 and m["time_share_verify"] + m["time_share_plain"] > 0
        assert m["time_share_verify"] > 0 or not m["spec_draft_tokens"], m
    shares = summary["time_and_accept"]["mtp_trained"]
    assert shares["accept_length_token_weighted"] >= 1.0 and shares["time_share_draft"] > 0
    assert "rollout time: engine steps" in proc.stdout and "token-weighted" in proc.stdout
