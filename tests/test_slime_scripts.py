"""Upstream slime's own run scripts, argument arrays unchanged but for paths (tests/data/slime_scripts), pass
`slime-spec doctor --rollout-backend sglang` on stand-in checkpoints shaped like their models: a slime user changes
nothing. GLM-4.7-Flash's script keeps one refusal, of its layout: on its 8 GPUs, EP 8 x PP 2 is 16 ranks, which
megatron-core's initialize_model_parallel refuses as well."""

import json

import pytest

from slime_spec.doctor.diagnose import main
from tests.helpers.slime_scripts import DENSE, SCRIPTS, script_argv

# A layout megatron-core refuses (nothing else may stop a script).
MOE_REFUSALS = {
    "run-glm4.7-30B-A3B": {("FLAG_CONFLICT", "")},
}


def doctor(capsys, argv):
    rc = main([*argv, "--rollout-backend", "sglang", "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _refusal(finding: dict) -> tuple[str, str]:
    flag = finding["message"].split(":")[0] if finding["code"] == "FLAG_NOT_SUPPORTED" else ""
    return finding["code"], flag


@pytest.mark.parametrize("name", SCRIPTS)
def test_upstream_script_passes_doctor(capsys, tmp_path, name):
    rc, out = doctor(capsys, script_argv(name, tmp_path))
    errors = {_refusal(f) for f in out["findings"] if f["level"] == "error"}
    assert errors == MOE_REFUSALS.get(name, set()), out["findings"]  # those go as the trainer learns them
    assert rc == (2 if errors else 0)
    codes = [f["code"] for f in out["findings"]]
    assert "UNKNOWN_FLAG" not in codes and "MODEL_ARGS_MISMATCH" not in codes
    # the flags it sets that change nothing here read in a few grouped lines, not one line per flag
    assert codes.count("FLAG_NOT_HONOURED") <= 8


@pytest.mark.parametrize("name", DENSE)
def test_dense_scripts_get_slimes_colocated_defaults(capsys, tmp_path, name):
    """--colocate on 8 GPUs without --rollout-num-gpus: one engine per --rollout-num-gpus-per-engine GPUs, each
    with the memory saver and the draft's CPU backup, as slime starts them."""
    _, out = doctor(capsys, script_argv(name, tmp_path))
    per_engine = {"run-qwen3-4B": 2, "run-mimo-7B-rl-eagle": 1}[name]
    assert len(out["engines"]) == 8 // per_engine
    assert [e["argv"][e["argv"].index("--base-gpu-id") + 1] for e in out["engines"]] == \
        [str(i * per_engine) for i in range(8 // per_engine)]
    for engine in out["engines"]:
        assert {"--enable-memory-saver", "--enable-draft-weights-cpu-backup"} <= set(engine["argv"])
    balance = [f for f in out["findings"] if "--balance-data" in f["message"]]
    assert [f["level"] for f in balance] == ["info"]  # --max-tokens-per-gpu already balances by tokens


def test_mla_script_has_no_false_qkv_bias_mismatch(capsys, tmp_path):
    """GLM-4.7's MODEL_ARGS pass --add-qkv-bias with --multi-latent-attention: Megatron's MLA projections have no
    bias, so the flag changes nothing and config.json's attention_bias=false agrees."""
    _, out = doctor(capsys, script_argv("run-glm4.7-30B-A3B", tmp_path))
    assert not [f for f in out["findings"] if "--add-qkv-bias" in f["message"]]
    argv = [t for t in script_argv("run-glm4.7-30B-A3B", tmp_path) if t != "--multi-latent-attention"]
    _, out = doctor(capsys, argv)
    assert [f["code"] for f in out["findings"] if "--add-qkv-bias" in f["message"]] == ["MODEL_ARGS_MISMATCH"]
