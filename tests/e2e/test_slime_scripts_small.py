"""Upstream slime's dense run scripts (run-qwen3-4B.sh, run-mimo-7B-rl-eagle.sh: their argument arrays, paths
changed only) train two GRPO steps on a tiny stand-in of their model, with scripts/common.sh's SMALL_MACHINE=1
overrides, through `python -m slime_spec.train`: a slime user changes nothing but the paths (Qwen3's run, with NGRAM
rollout and --check-weight-sync appended as a user may, also checks every synced tensor and the trainer's log-probs
against the engine's; a moved policy's sync is checked in tests/test_qwen3_family.py). So do our own native-MTP
scripts (scripts/run-glm4.5-mtp.sh, scripts/run-deepseek-v3-mtp.sh): run with SMALL_MACHINE=1 on a tiny stand-in, the
flags each hands on (recorded where the script calls its doctor) train the policy and the MTP layer online with
speculative rollout and a checked weight sync (GLM-4.5's: every target and MTP tensor, trainer and engine log-probs
within 1e-4); DeepSeek-V3's stand-in is block-wise FP8 as its release is, so its colocated sync sends FP8 weights with
fresh scales through the tensor transport, which the engine pairs and dequantizes, and the checksums are SGLang's for
an FP8 model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.slime_scripts import small_machine_argv, without_model_args

ROOT = Path(__file__).resolve().parents[2]
ARCH = {"run-qwen3-4B": "qwen3", "run-mimo-7B-rl-eagle": "mimo"}
# What a user may append to a script (EXTRA_ARGS), per script: Qwen3's run also speculates with NGRAM and reads every
# synced tensor back (--check-weight-sync), so Qwen3's trainer, sync and engine are checked against each other here
EXTRA = {"run-qwen3-4B": "--check-weight-sync --sglang-speculative-algorithm NGRAM "
                         "--sglang-speculative-num-draft-tokens 3",
         "run-mimo-7B-rl-eagle": ""}


@pytest.mark.parametrize("name", ["run-qwen3-4B", pytest.param("run-mimo-7B-rl-eagle", marks=pytest.mark.nightly(
    covered_by="tests/e2e/test_slime_scripts_small.py::test_dense_slime_script_trains_two_grpo_steps_on_a_tiny_stand_in"
               "[run-qwen3-4B]"))])
def test_dense_slime_script_trains_two_grpo_steps_on_a_tiny_stand_in(tmp_path, name):
    model = make_tiny_model(tmp_path / "model", arch=ARCH[name], mtp_layers=1, hidden_size=32, num_layers=1,
                            intermediate_size=64, max_position_embeddings=1024, seed=3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "WANDB_"))}
    env.update(SMALL_MACHINE="1", HF_CHECKPOINT=str(model), OUTPUT_DIR=str(tmp_path / "run"),
               CKPT_DIR=str(tmp_path / "ckpt"),
               EXTRA_ARGS=f"--ref-load {model} {EXTRA[name]}")  # --ref-load: the script's is a torch_dist path
    argv = small_machine_argv(without_model_args(name, tmp_path), env, ROOT)
    done = subprocess.run([sys.executable, "-m", "slime_spec.train", *argv], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=540)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["rollout_id"] for s in steps] == [0, 1]
    assert out.count("Started a local Ray instance") == 1 and "Token authentication" not in out
    if name == "run-qwen3-4B":
        config = json.loads((model / "config.json").read_text())
        # per layer q/k/v/o, q_norm, k_norm, 2 norms, and gate/up/down; embedding, norm, head
        tensors = config["num_hidden_layers"] * (8 + 3) + 2 + (not config["tie_word_embeddings"])
        for m in steps:
            assert m["spec_verify_ct"] > 0 and m["spec_accept_length"] >= 1.0  # NGRAM drafted and verified
            assert m["weight_sync_params"] == tensors and m["weight_sync_checked"] == 1  # the engine's sums agree
            assert m["train_rollout_logprob_abs_diff"] < 1e-4  # the engine's Qwen3 and the trainer's agree


# Test double for the scripts' interpreter: records the flags a script hands its doctor (the job's flags, the same
# array); the script's own import check (`python -c ...`) goes to the real interpreter.
RECORD_FLAGS = """#!/bin/bash
if [ "$1" = -c ]; then exec "$REAL_PY" "$@"; fi
printf '%s\\0' "$@" > "$FLAGS_FILE"
"""
OWN_SCRIPTS = {"run-glm4.5-mtp.sh": "glm4_moe", "run-deepseek-v3-mtp.sh": "deepseek_v3"}


def own_script_flags(script: str, env: dict, tmp_path: Path) -> list[str]:
    """The flags `scripts/<script>` would submit as the job, under the environment `env` (DOCTOR_ONLY=1)."""
    fake = tmp_path / "record-flags"
    fake.write_text(RECORD_FLAGS)
    fake.chmod(0o755)
    flags_file = tmp_path / "script.flags"
    env = {**env, "DOCTOR_ONLY": "1", "PYTHON": str(fake), "REAL_PY": sys.executable, "FLAGS_FILE": str(flags_file)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / script)], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    flags = [t for t in flags_file.read_text().split("\0") if t]
    assert flags[:2] == ["-m", "slime_spec.doctor.diagnose"]
    return flags[2:]


# DeepSeek-V3 ships block-wise FP8: its stand-in too (SGLang's FP8 layers need in-features that are multiples of 128)
STAND_IN = {"glm4_moe": dict(hidden_size=32, intermediate_size=64),
            "deepseek_v3": dict(hidden_size=512, intermediate_size=256, dtype="bfloat16", fp8=True)}


@pytest.mark.parametrize("script", ["run-deepseek-v3-mtp.sh", pytest.param(
    "run-glm4.5-mtp.sh", marks=pytest.mark.nightly(
    covered_by="tests/e2e/test_slime_scripts_small.py::test_own_mtp_script_trains_policy_and_mtp_layer_on_a_tiny_stand_in"
               "[run-deepseek-v3-mtp.sh]"))])
def test_own_mtp_script_trains_policy_and_mtp_layer_on_a_tiny_stand_in(tmp_path, script, ray_head):
    arch = OWN_SCRIPTS[script]
    model = make_tiny_model(tmp_path / "model", arch=arch, mtp_layers=1, num_layers=2, max_position_embeddings=1024,
                            first_k_dense_replace=1, seed=3, **STAND_IN[arch])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(4)))
    env = ray_head.driver_env({k: v for k, v in os.environ.items() if not k.startswith("WANDB_")})
    env.update(SMALL_MACHINE="1", HF_CHECKPOINT=str(model), PROMPT_DATA=str(prompts), EVAL_PROMPT_DATA="",
               OUTPUT_DIR=str(tmp_path / "run"), CKPT_DIR=str(tmp_path / "ckpt"), EXTRA_ARGS="--check-weight-sync")
    flags = own_script_flags(script, env, tmp_path)
    for kept in ("--enable-mtp-training", "--colocate", "--sglang-speculative-algorithm"):
        assert kept in flags, kept  # online MTP training and speculative rollout stay on, as on the cluster
    done = subprocess.run([sys.executable, "-m", "slime_spec.train", *flags], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=540)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["rollout_id"] for s in steps] == [0, 1]
    for s in steps:
        assert s["spec_verify_ct"] > 0 and s["spec_draft_tokens"] > 0  # the MTP layer drafted, the target verified
        assert s["mtp_loss"] > 0  # and the MTP layer was trained
        assert s["weight_sync_mtp_params"] > 0 and s["weight_sync_checked"] == 1  # synced, the engine's sums agree
    assert any(s["grad_norm"] > 0 for s in steps)  # the policy moved, and the checked sync carried it
    if arch == "glm4_moe":
        config = json.loads((model / "config.json").read_text())
        # layer 0 dense: 2 norms, q/k/v weight and bias, o, gate/up/down; layer 1 and the MTP layer sparse: the router
        # and its correction bias, each expert's three, the shared expert's three; the MTP layer adds enorm, hnorm,
        # eh_proj and shared_head.norm (its embedding and head copies are not sent: the NextN runner shares the
        # target's)
        dense, sparse = 2 + 7 + 3, 2 + 7 + 2 + 3 * config["n_routed_experts"] + 3
        for s in steps:
            assert s["weight_sync_params"] == dense + sparse + 3 and s["weight_sync_mtp_params"] == sparse + 4
            assert s["train_rollout_logprob_abs_diff"] < 1e-4  # the engine's GLM-4.5 and the trainer's agree
    if arch == "deepseek_v3":  # every FP8 weight went with its scale: as many tensors as the checkpoint holds, but the
        # MTP layer's embedding and head copies (the NextN runner takes the target's)
        from safetensors.torch import load_file
        stored = list(load_file(str(model / "model.safetensors")))
        mtp = [n for n in stored if n.startswith("model.layers.2.")]
        assert any(n.endswith("weight_scale_inv") for n in mtp)
        for s in steps:
            assert s["weight_sync_params"] == len(stored) - len(mtp) and s["weight_sync_mtp_params"] == len(mtp) - 2
