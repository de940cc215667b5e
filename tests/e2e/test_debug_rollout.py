"""`--debug-rollout-only` end to end: real Ray, two embedded engines, NGRAM and MTP (NEXTN) speculation."""

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
from slime_spec.rollout.debug_data import load_rollout
from slime_spec.rollout.debug_rollout import run_debug_rollout_only
from slime_spec.rollout.metrics import REQUIRED_KEYS
from slime_spec.tools.tiny_model import make_tiny_model

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


def _check(tmp_path, summary, spec_expected_to_draft: bool):
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in lines] == list(range(NUM_ROLLOUT))
    for m in lines:
        assert set(REQUIRED_KEYS) <= set(m)
        assert m["num_samples"] == BATCH * N_SAMPLES and m["aborted"] == 0 and m["engine_restarts"] == 0
        assert m["spec_accept_length"] >= 1.0 and m["spec_verify_ct"] > 0
        assert m["spec_completion_tokens"] == m["response_tokens"]
        assert m["engine_0/num_samples"] + m["engine_1/num_samples"] == m["num_samples"]
        assert m["engine_0/num_samples"] > 0 and m["engine_1/num_samples"] > 0
        # each engine's verify passes add up to the rollout's
        assert m["engine_0/spec_verify_ct"] + m["engine_1/spec_verify_ct"] == m["spec_verify_ct"]
        if spec_expected_to_draft:
            assert m["spec_draft_tokens"] > 0 and 0.0 <= m["spec_accept_rate"] <= 1.0
        samples = load_rollout(str(tmp_path / "data" / "rollout_{rollout_id}.pt"), m["rollout_id"])
        assert sum(s.response_length for s in samples) == m["response_tokens"]
        assert sum(s.spec.verify_ct for s in samples) == m["spec_verify_ct"]
    assert summary["num_rollouts"] == NUM_ROLLOUT and summary["num_samples"] == NUM_ROLLOUT * BATCH * N_SAMPLES
    assert summary["response_tokens"] == sum(m["response_tokens"] for m in lines)
    assert summary["spec_accept_length_token_weighted"] >= 1.0


def test_debug_rollout_only_ngram_two_engines(ray_cluster, tmp_path):
    model = make_tiny_model(tmp_path / "llama", arch="llama", seed=1)
    summary = run_debug_rollout_only(_config(tmp_path, model, ("--speculative-algorithm", "NGRAM")),
                                     show_progress=False)
    _check(tmp_path, summary, spec_expected_to_draft=True)


def test_debug_rollout_only_mtp_two_engines(ray_cluster, tmp_path):
    model = make_tiny_model(tmp_path / "mimo", arch="mimo", mtp_layers=1, seed=2)
    spec = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "3")
    summary = run_debug_rollout_only(_config(tmp_path, model, spec), show_progress=False)
    _check(tmp_path, summary, spec_expected_to_draft=True)
