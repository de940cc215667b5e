"""scripts/run-eagle3-llama3.1-8B.sh on a tiny stand-in, on CPU, as a user runs it on a small machine.

A tiny Llama (llama3 RoPE scaling, 4 layers) and a random EAGLE3 draft for it (`make-tiny-model
--eagle3-draft`) replace the 8B pair through the documented overrides (SMALL_MACHINE=1, HF_CHECKPOINT,
DRAFT_CHECKPOINT). The script passes its doctor, starts its own Ray head, and the job runs two GRPO steps
with EAGLE3 speculative rollout on the embedded engine and the draft trained online (--enable-draft-training)
and synced with selector `draft`. The script's own 5 / 8 / 32 EAGLE3 tree runs as written (no override).
"""

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from slime_spec.tools.tiny_model import LLAMA31_ROPE_SCALING, make_tiny_eagle3_draft, make_tiny_model
from tests.e2e.test_ray_job import group_alive, head_ports, port_open, workdir  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "run-eagle3-llama3.1-8B.sh"


@pytest.mark.nightly(
    covered_by="tests/test_trainer_tp.py::"
               "test_qwen3_moe_tp2_sequence_parallel_with_an_online_eagle3_draft_equals_tp1_and_syncs")
def test_eagle3_script_trains_the_draft_online_on_a_tiny_stand_in(workdir):  # noqa: F811
    tmp, ray_tmp = workdir
    # 2048 positions: the script serves --sglang-context-length 2048, which SGLang refuses above the model's own
    model = make_tiny_model(tmp / "model", arch="llama", hidden_size=32, num_layers=4, intermediate_size=64,
                            max_position_embeddings=2048, seed=3, rope_scaling=LLAMA31_ROPE_SCALING)
    draft = make_tiny_eagle3_draft(tmp / "draft", model)
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(12)))
    token = tmp / "ray_auth_token"
    token.write_text(uuid.uuid4().hex)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "WANDB_")) and k not in ("DEBUG_ROLLOUT_ONLY", "DOCTOR_ONLY", "EXTRA_ARGS")}
    env.update(
        PYTHON=sys.executable, SMALL_MACHINE="1", HF_CHECKPOINT=str(model), DRAFT_CHECKPOINT=str(draft),
        PROMPT_DATA=str(data), EVAL_PROMPT_DATA=str(data), BASE_DIR=str(tmp), CKPT_DIR=str(tmp / "ckpt"),
        OUTPUT_DIR=str(tmp / "out"), MASTER_ADDR="127.0.0.1", RAY_TEMP_DIR=str(ray_tmp), RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        # the tiny vocabulary has no math answers: exact_match keeps the reward defined
        EXTRA_ARGS="--rm-type exact_match --rollout-skip-special-tokens --eval-interval 1",
    )
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the script's trap stops its job and its head
        out, _ = proc.communicate(timeout=60)
        pytest.fail("the script did not finish in 300 s:\n" + out[-6000:])
    head = re.search(r"stopping the Ray head this script started \(process group (\d+)\)", out)
    try:
        assert proc.returncode == 0, out[-6000:]
        gcs, dashboard = head_ports(out)
        assert "0 error(s), 0 warning(s)" in out  # the doctor passed the stand-in configuration
        assert re.search(r"Job 'run-eagle3-llama3.1-8B-[\w-]+' succeeded", out), out[-3000:]
        entry = out.split("Running entrypoint for job", 1)[1].splitlines()[0]
        for flag in ("--sglang-speculative-algorithm EAGLE3", "--enable-draft-training", "--draft-ttt-steps 7",
                     f"--sglang-speculative-draft-model-path {draft}", "--sglang-speculative-eagle-topk 8",
                     "--sglang-speculative-num-draft-tokens 32"):
            assert flag in entry, flag

        steps = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
        assert [s["rollout_id"] for s in steps] == [0, 1]
        for s in steps:
            assert s["num_samples"] == 4 and s["spec_verify_ct"] > 0 and s["spec_accept_length"] >= 1.0
            assert s["draft_loss"] > 0  # the draft trained online on the rollouts
            assert s["weight_sync_params"] > 0 and s["weight_sync_draft_params"] > 0  # target and draft synced
            assert s["weight_sync_mtp_params"] == 0
            assert s["eval/eval/num_samples"] == 12
        saved = tmp / "ckpt" / "iter_0000001" / "eagle3_draft"
        assert json.loads((saved / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
        assert (tmp / "out" / "plot.png").stat().st_size > 1000
    finally:
        assert head, "the script did not start (or did not report) a Ray head:\n" + out[-3000:]
        pgid = int(head.group(1))
        if group_alive(pgid):  # the script should have stopped it: never leave a head behind
            os.killpg(pgid, signal.SIGKILL)
            pytest.fail(f"the Ray head's process group {pgid} outlived the script")
    assert not port_open(gcs) and not port_open(dashboard)
