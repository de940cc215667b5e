"""The Qwen3-235B-A22B EAGLE3 seed row at tiny size through the whole loop: a Qwen3-MoE target on two train ranks laid
out as slime's MoE scripts lay them out, TP 2 and EP 2 on the same two ranks with whole experts
(--expert-tensor-parallel-size 1), so the loop runs megatron-core's sequence parallelism and its expert-parallel token
dispatch at once, and an EAGLE3 draft trained online beside it (--enable-draft-training): `python -m slime_spec.train
--actor-num-gpus-per-node 2`, two GRPO steps on CPU (gloo), EAGLE3 speculative rollout on the embedded engine, every
step's target weights (every expert, whole) and draft weights synced into the engine and checked against it
(--check-weight-sync). TP alone and EP alone are pinned against one rank, sync included, in tests/test_trainer_tp.py
and tests/test_trainer_ep.py."""

import json

import pytest

from slime_spec.tools.tiny_model import make_tiny_eagle3_draft, make_tiny_model
from tests.helpers.train_loops import run_grpo_steps

TP2_EP2 = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
           "--expert-tensor-parallel-size", "1"]


@pytest.mark.nightly(
    covered_by="tests/test_trainer_ep.py::test_ep2_equals_ep1_forward_gather_train_step_sync_and_resume")
def test_qwen3_moe_with_an_online_eagle3_draft_two_grpo_steps_at_tp2_ep2(tmp_path):
    model = make_tiny_model(tmp_path / "model", arch="qwen3_moe", hidden_size=32, num_layers=4, intermediate_size=64,
                            max_position_embeddings=128, num_experts=4, seed=3)
    draft = make_tiny_eagle3_draft(tmp_path / "draft", model, draft_vocab_size=40)
    eagle3 = ["--sglang-speculative-algorithm", "EAGLE3", "--sglang-speculative-draft-model-path", str(draft),
              "--sglang-speculative-num-steps", "2", "--sglang-speculative-eagle-topk", "1",
              "--sglang-speculative-num-draft-tokens", "3", "--enable-draft-training"]
    steps = run_grpo_steps(tmp_path, model, ["--actor-num-gpus-per-node", "2", *TP2_EP2, *eagle3,
                                             "--check-weight-sync"])
    config = json.loads((model / "config.json").read_text())
    # per layer q/k/v/o, q_norm, k_norm, 2 norms, the router and each expert's gate/up/down; embedding, norm, head
    tensors = config["num_hidden_layers"] * (8 + 1 + 3 * config["num_experts"]) + 2 + \
        (not config["tie_word_embeddings"])
    for m in steps:
        assert m["spec_verify_ct"] > 0 and m["spec_draft_tokens"] > 0  # the EAGLE3 draft drafted, the target verified
        assert m["draft_loss"] > 0  # and it trained online on the rollouts
        assert m["weight_sync_params"] == tensors and m["weight_sync_mtp_params"] == 0
        assert m["weight_sync_draft_params"] > 0  # the trained draft reached the engine too
        assert m["weight_sync_checked"] == 1  # the engine's checksums matched what was sent
        assert m["train_rollout_logprob_abs_diff"] < 1e-4  # the split trainer and the engine agree
    assert any(m["grad_norm"] > 0 for m in steps)  # the policy moved, and the checked sync carried it
