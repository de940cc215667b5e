"""A tiny Qwen3 through the whole loop: `python -m slime_spec.train`, two GRPO steps on CPU, NGRAM speculative rollout
on the embedded engine, every step's weights synced and checked against the engine (--check-weight-sync). Qwen3-MoE
runs the same loop on two ranks (tests/test_trainer_ep_loop.py)."""

import json

from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.train_loops import run_grpo_steps


def test_qwen3_two_grpo_steps_with_ngram_rollout_and_checked_sync(tmp_path, ray_head):
    model = make_tiny_model(tmp_path / "model", arch="qwen3", hidden_size=32, num_layers=2, intermediate_size=64,
                            max_position_embeddings=128, seed=3)
    steps = run_grpo_steps(tmp_path, model, ["--sglang-speculative-algorithm", "NGRAM",
                                             "--sglang-speculative-num-draft-tokens", "3", "--check-weight-sync"],
                           ray_head)
    config = json.loads((model / "config.json").read_text())
    # per layer q/k/v/o, q_norm, k_norm, 2 norms, and gate/up/down; embedding, norm, head
    tensors = config["num_hidden_layers"] * (8 + 3) + 2 + (not config["tie_word_embeddings"])
    for m in steps:
        assert m["spec_verify_ct"] > 0 and m["spec_accept_length"] >= 1.0  # NGRAM drafted and verified
        assert m["weight_sync_params"] == tensors and m["weight_sync_mtp_params"] == 0
        assert m["weight_sync_checked"] == 1  # the engine's checksums matched what was sent
        # the engine's Qwen3 and the trainer's agree on the sampled tokens' log-probabilities
        assert m["train_rollout_logprob_abs_diff"] < 1e-4
    assert any(m["grad_norm"] > 0 for m in steps)  # the policy moved, and the checked sync carried it
