"""`--debug-rollout-only` end to end: real Ray, two embedded engines, NGRAM speculation (MTP (NEXTN) speculation on two
engines runs through the command line in tests/e2e/test_train_loop.py)."""

import json

import pytest
import ray

from slime_spec.config.run_config import (
    ClusterConfig,
    Config,
    EngineConfig,
    RolloutConfig,
    TrainConfig,
    WandbConfig,
    WeightSyncConfig,
)
from slime_spec.rollout.debug_rollout import run_debug_rollout_only
from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.rollout_checks import check_rollouts_on_two_engines

NUM_ROLLOUT, BATCH, N_SAMPLES = 2, 3, 2


@pytest.fixture(scope="module")
def ray_cluster():
    if ray.is_initialized():  # another module's cluster: this module needs its own resources
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def _config(tmp_path, model, spec_argv):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"input": "abc abc abc " * (i + 1), "label": "abc"}) for i in range(4)))
    rollout = RolloutConfig(hf_checkpoint=str(model), prompt_data=str(prompts), label_key="label",
                            rm_type="exact_match", num_rollout=NUM_ROLLOUT, rollout_batch_size=BATCH,
                            n_samples_per_prompt=N_SAMPLES, rollout_max_response_len=16, rollout_temperature=0.8,
                            sglang_server_concurrency=2, metrics_jsonl=str(tmp_path / "metrics.jsonl"),
                            save_debug_rollout_data=str(tmp_path / "data" / "rollout_{rollout_id}.pt"))
    return Config(cluster=ClusterConfig(rollout_num_engines=2),
                  engine=EngineConfig(backend="embedded", model_path=str(model), forwarded_argv=spec_argv),
                  rollout=rollout, train=TrainConfig(hf_checkpoint=str(model)), weight_sync=WeightSyncConfig(),
                  wandb=WandbConfig(), debug_rollout_only=True, output_dir=str(tmp_path / "out"))


@pytest.mark.nightly(covered_by="tests/e2e/test_train_loop.py::test_debug_rollout_only_then_debug_train_only")
def test_debug_rollout_only_ngram_two_engines(ray_cluster, tmp_path):
    model = make_tiny_model(tmp_path / "llama", arch="llama", seed=1)
    summary = run_debug_rollout_only(_config(tmp_path, model, ("--speculative-algorithm", "NGRAM")),
                                     show_progress=False)
    saved = str(tmp_path / "data" / "rollout_{rollout_id}.pt")
    lines = check_rollouts_on_two_engines(tmp_path / "metrics.jsonl", saved, NUM_ROLLOUT, BATCH * N_SAMPLES)
    assert summary["num_rollouts"] == NUM_ROLLOUT and summary["num_samples"] == NUM_ROLLOUT * BATCH * N_SAMPLES
    assert summary["response_tokens"] == sum(m["response_tokens"] for m in lines)
    assert summary["spec_accept_length_token_weighted"] >= 1.0
