"""A tiny GLM-4.7-Flash (glm4_moe_lite: DeepSeek-V3's architecture with GLM's defaults) with its NextN MTP layer
through the whole loop: `python -m slime_spec.train`, two GRPO steps on CPU with the trainer's megatron-core MLA + MoE
model and its MTP layer trained online, on two pipeline stages as slime's GLM-4.7 and DeepSeek scripts ask for stages
(the dense layer on the first; the MoE layer, the output layer and the MTP layer on the last; megatron-core's 1F1B
schedule over two micro-batches per step, every stage's weights sent to the engine by rank 0), NEXTN speculative
rollout on the embedded engine drafting with that layer, every step's target and MTP tensors synced and checked
against the engine's runners (--check-weight-sync), the engine's log-probs taken as the old policy's as GLM-4.7's
script does (--use-rollout-logprobs). DeepSeek-V3 itself, in its FP8 release format, runs through
scripts/run-deepseek-v3-mtp.sh (tests/e2e/test_slime_scripts_small.py)."""

import json

import pytest

from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.train_loops import run_grpo_steps


@pytest.mark.nightly(
    covered_by="tests/e2e/test_slime_scripts_small.py::"
               "test_own_mtp_script_trains_policy_and_mtp_layer_on_a_tiny_stand_in[run-deepseek-v3-mtp.sh]")
def test_two_grpo_steps_on_two_stages_with_trained_mtp_and_nextn_rollout(tmp_path, ray_head):
    model = make_tiny_model(tmp_path / "model", arch="glm4_moe_lite", hidden_size=32, num_layers=2,
                            intermediate_size=64, max_position_embeddings=128, mtp_layers=1, first_k_dense_replace=1,
                            seed=3)
    steps = run_grpo_steps(tmp_path, model, [
        "--sglang-speculative-algorithm", "NEXTN", "--sglang-speculative-num-steps", "2",
        "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "3",
        "--mtp-num-layers", "1", "--enable-mtp-training", "--check-weight-sync",
        "--use-rollout-logprobs", "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2"], ray_head)
    config = json.loads((model / "config.json").read_text())
    # layer 0 dense: 2 norms, MLA's q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    # o_proj, gate/up/down; layer 1 and the MTP layer sparse: the router and its correction bias, each expert's three,
    # the shared expert's three; the MTP layer adds enorm, hnorm, eh_proj and shared_head.norm (its embedding and head
    # copies are not sent: the NextN runner shares the target's)
    dense, sparse = 2 + 7 + 3, 2 + 7 + 2 + 3 * config["n_routed_experts"] + 3
    for m in steps:
        assert m["spec_verify_ct"] > 0 and m["spec_draft_tokens"] > 0  # the NextN layer drafted, the target verified
        assert m["weight_sync_params"] == dense + sparse + 3 and m["weight_sync_mtp_params"] == sparse + 4
        assert m["weight_sync_checked"] == 1  # target and draft runners' checksums matched what was sent
        assert m["train_rollout_logprob_abs_diff"] < 1e-4  # the engine's model and the trainer's agree
        assert m["mtp_loss"] > 0
    assert any(m["grad_norm"] > 0 for m in steps)

