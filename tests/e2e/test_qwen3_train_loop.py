"""A tiny Qwen3 and Qwen3-MoE through the whole loop: `python -m slime_spec.train`, two GRPO steps on CPU, NGRAM
speculative rollout on the embedded engine, every step's weights synced and checked against the engine
(--check-weight-sync)."""

import json
import os
import subprocess
import sys

import pytest

from slime_spec.tools.tiny_model import make_tiny_model

# A reward that differs between a prompt's samples (a random model never answers right), so GRPO's advantages,
# and the step's gradients, are not all zero.
DIGIT_SHARE_RM = '''
def digit_share(sample):
    return sum(c.isdigit() for c in sample.response) / max(1, len(sample.response))
'''


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_qwen3_two_grpo_steps_with_ngram_rollout_and_checked_sync(tmp_path, arch):
    model = make_tiny_model(tmp_path / "model", arch=arch, hidden_size=32, num_layers=2, intermediate_size=64,
                            max_position_embeddings=128, seed=3)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(12)))
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "qwen3_loop_rm.py").write_text(DIGIT_SHARE_RM)
    argv = [sys.executable, "-m", "slime_spec.train", "--hf-checkpoint", str(model), "--rollout-backend", "embedded",
            "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
            "--custom-rm-path", "qwen3_loop_rm.digit_share", "--num-rollout", "2", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8", "--global-batch-size", "8",
            "--micro-batch-size", "4", "--lr", "1e-3", "--output-dir", str(tmp_path / "out"),
            "--sglang-speculative-algorithm", "NGRAM", "--sglang-speculative-num-draft-tokens", "3",
            "--check-weight-sync"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path / "rm"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=420, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in steps] == [0, 1]
    config = json.loads((model / "config.json").read_text())
    # per layer q/k/v/o, q_norm, k_norm, 2 norms, and gate/up/down (qwen3_moe: the router and each expert's three)
    mlp = 1 + 3 * config["num_experts"] if arch == "qwen3_moe" else 3
    tensors = config["num_hidden_layers"] * (8 + mlp) + 2 + (not config["tie_word_embeddings"])
    for m in steps:
        assert m["spec_verify_ct"] > 0 and m["spec_accept_length"] >= 1.0  # NGRAM drafted and verified
        assert m["weight_sync_params"] == tensors and m["weight_sync_mtp_params"] == 0
        assert m["weight_sync_checked"] == 1  # the engine's checksums matched what was sent
        # the engine's Qwen3 and the trainer's agree on the sampled tokens' log-probabilities
        assert m["train_rollout_logprob_abs_diff"] < 1e-4
    assert any(m["grad_norm"] > 0 for m in steps)  # the policy moved, and the checked sync carried it
