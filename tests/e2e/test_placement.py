"""--colocate on a Ray cluster with GPUs: one placement group, train actors and engines sharing its bundles.

Ray's GPUs here are logical (`ray.init(num_gpus=2)` on a CPU machine): Ray schedules and sets
CUDA_VISIBLE_DEVICES as on a real node, while torch sees no CUDA, so the trainer runs gloo and the
embedded engines pick device cpu. 2 actor GPUs and 2 rollout GPUs colocated need 2 bundles; asking
Ray for 2 + 2 whole GPUs (the deadlock this guards against) would time out instead of finishing.
"""

import json
import time
from pathlib import Path

import pytest
import ray

from slime_spec.cluster.placement import create_placement, remove_placement
from slime_spec.driver.loop import main
from slime_spec.tools.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def gpus_free_again(timeout_s: float = 30.0) -> bool:
    """Removing a placement group returns its GPUs asynchronously."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU") != 2:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    model = make_tiny_model(root / "model", arch="mimo", mtp_layers=1, hidden_size=32, num_layers=1,
                            intermediate_size=64, max_position_embeddings=128, seed=3)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(8)))
    if ray.is_initialized():  # another module's cluster: this one needs its logical GPUs
        ray.shutdown()
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield root, model, data
    ray.shutdown()


def test_placement_that_cannot_fit_times_out_naming_request_and_cluster(gpu_cluster):
    with pytest.raises(TimeoutError) as e:
        create_placement(actor_gpus=2, rollout_gpus=2, gpus_per_engine=1, colocate=False, timeout_s=2)
    msg = str(e.value)
    assert "4 bundles" in msg and "within 2 s (--placement-timeout)" in msg and "GPU=2" in msg and "--colocate" in msg
    assert gpus_free_again()  # the pending group was removed


def test_colocate_two_actor_and_two_rollout_gpus_on_two_gpus(gpu_cluster, capsys):
    """Two colocated steps of the whole loop: NEXTN rollout drafting with the MTP layer trained online, both synced
    every step, a checkpoint every step, --use-tis weighing the policy loss by the engine's log-probs."""
    root, model, data = gpu_cluster
    out = root / "run"
    argv = ["--hf-checkpoint", str(model), "--rollout-backend", "embedded", "--colocate",
            "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--rollout-num-engines", "2",
            "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label", "--rm-type", "exact_match",
            "--rollout-skip-special-tokens", "--num-rollout", "2", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--lr", "1e-3", "--placement-timeout", "120", "--output-dir", str(out),
            "--mtp-num-layers", "1", "--enable-mtp-training", "--sglang-speculative-algorithm", "NEXTN",
            "--sglang-speculative-num-steps", "2", "--sglang-speculative-eagle-topk", "1",
            "--sglang-speculative-num-draft-tokens", "3", "--save", str(root / "ckpt"), "--save-interval", "1",
            "--use-tis", "--normalize-advantages", "--eps-clip-c", "3"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "[placement] train rank 1" in printed and "[placement] engine 1" in printed
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in steps] == [0, 1]
    assert all((root / "ckpt" / f"iter_{i:07d}" / "tp_rank_00.pt").exists() for i in range(2))
    for m in steps:
        assert m["num_samples"] == 4 and m["spec_accept_length"] >= 1.0 and "loss" in m
        # target AND MTP layers reached the engines
        assert m["weight_sync_params"] > 0 and m["weight_sync_mtp_params"] > 0
        assert m["spec_canary_accept_length"] >= 1.0
        # --use-tis (with --normalize-advantages and --eps-clip-c, whose bound cannot bite in a first epoch, where the
        # ratio is 1): the engine's log-probs (the target's, under speculation) weigh the policy loss
        assert 0 < m["tis"] and 0 <= m["tis_clipfrac"] <= 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_steps"] == 2 and (out / "plot.png").stat().st_size > 1000
    assert gpus_free_again()  # the run's placement group is gone


def test_engines_get_their_sorted_bundle_gpus(gpu_cluster):
    p = create_placement(actor_gpus=2, rollout_gpus=2, gpus_per_engine=1, colocate=True, timeout_s=60)
    try:
        assert sorted(g for (g,) in p.assignment.engine_gpus) == [0, 1]
        assert p.assignment.engine_gpus == ((0,), (1,))  # sorted by GPU id on the one node
        assert list(p.assignment.actor_bundles) == [b for (b,) in p.assignment.engine_bundles]
    finally:
        remove_placement(p)
