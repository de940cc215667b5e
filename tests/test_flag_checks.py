"""Bad configurations doctor must stop before anything starts, each with its code; good ones stay clean."""

import json

import pytest

from slime_spec.cluster.gpu_check import compare_gpus
from slime_spec.config.args import parse
from slime_spec.doctor import flag_checks
from slime_spec.doctor.diagnose import diagnose

BASE = ["--rollout-backend", "embedded"]

# (extra flags, the code doctor must give). The first eleven were missed before flag_checks; the SGLang
# quantization one was already caught by EMBEDDED_FLAG_REFUSED and NGRAM's by SPEC_TOPK_TOKENS (kept here
# so they stay caught).
BAD = [
    (["--rollout-temperature", "-1"], "FLAG_OUT_OF_RANGE"),
    (["--rollout-top-p", "5"], "FLAG_OUT_OF_RANGE"),
    (["--n-samples-per-prompt", "0"], "FLAG_OUT_OF_RANGE"),
    (["--rollout-batch-size", "-5"], "FLAG_OUT_OF_RANGE"),
    (["--rollout-max-response-len", "0"], "FLAG_OUT_OF_RANGE"),
    (["--rollout-num-engines", "0"], "FLAG_OUT_OF_RANGE"),
    (["--sglang-mem-fraction-static", "7"], "FLAG_OUT_OF_RANGE"),
    (["--rollout-batch-size", "3", "--global-batch-size", "3", "--micro-batch-size", "2"], "FLAG_CONFLICT"),
    (["--rollout-num-gpus-per-engine", "2"], "FLAG_CONFLICT"),
    (["--tensor-model-parallel-size", "2"], "FLAG_CONFLICT"),
    (["--actor-num-gpus-per-node", "2", "--global-batch-size", "6", "--micro-batch-size", "2"], "FLAG_CONFLICT"),
    (["--mtp-unroll-steps", "0"], "FLAG_OUT_OF_RANGE"),
    (["--use-tis", "--tis-clip", "-1"], "FLAG_OUT_OF_RANGE"),
    (["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "2"], "FLAG_CONFLICT"),
    (["--use-tis", "--use-rollout-logprobs"], "FLAG_CONFLICT"),
    (["--num-steps-per-rollout", "2", "--global-batch-size", "2"], "FLAG_CONFLICT"),
    (["--rollout-batch-size", "5", "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "3"], "FLAG_CONFLICT"),
    (["--num-steps-per-rollout", "0"], "FLAG_OUT_OF_RANGE"),
    (["--custom-tis-function-path", "my.tis.fn"], "FLAG_NOT_SUPPORTED"),
    (["--eps-clip-c", "1.0"], "FLAG_OUT_OF_RANGE"),
    (["--rm-type", "dapo"], "RM_TYPE_UNKNOWN"),
    (["--rollout-batch-sise", "4"], "UNKNOWN_FLAG"),
    (["--rollout-function-path", "my.rollout.fn"], "FLAG_NOT_SUPPORTED"),
    (["--partial-rollout"], "FLAG_NOT_SUPPORTED"),
    (["--sglang-quantization", "fp8"], "EMBEDDED_FLAG_REFUSED"),
    (["--sglang-speculative-algorithm", "NGRAM", "--sglang-speculative-num-draft-tokens", "1"], "SPEC_TOPK_TOKENS"),
]

GOOD = [
    [],
    ["--rollout-temperature", "0", "--rollout-top-p", "1", "--rollout-top-k", "-1"],
    ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--micro-batch-size", "4"],
    ["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--rollout-batch-size", "6",
     "--global-batch-size", "6", "--micro-batch-size", "3"],
    # slime's way to ask for several optimizer steps per rollout
    ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "4"],
    # the client sends these keys (slime_spec/fleet/client.py EngineAuth): accepted, no finding
    ["--sglang-api-key", "k1", "--sglang-admin-api-key", "k2"],
    ["--rm-type", "math", "--recompute-granularity", "full", "--pipeline-model-parallel-size", "1",
     "--lr-decay-style", "constant", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216"],
    ["--rollout-batch-sise", "4", "--allow-unknown-flags"],
    # slime's truncated importance sampling, as its GRPO scripts set it
    ["--use-tis", "--tis-clip", "2.0", "--tis-clip-low", "0.0", "--normalize-advantages", "--eps-clip-c", "3"],
    ["--calculate-per-token-loss", "--use-rollout-logprobs"],
    ["--disable-grpo-std-normalization"], ["--disable-rewards-normalization"],
    # rollout only: trainer flags are not refused, since no trainer runs
    ["--debug-rollout-only", "--pipeline-model-parallel-size", "4", "--bf16", "--tensor-model-parallel-size", "8"],
]


def errors_of(mimo7b, extra):
    _, findings = diagnose(parse(["--hf-checkpoint", str(mimo7b), *BASE, *extra]), launching=False)
    return [f for f in findings if f.level == "error"], findings


@pytest.mark.parametrize("extra,code", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_config_is_stopped_with_its_code(mimo7b, extra, code):
    errors, _ = errors_of(mimo7b, extra)
    assert code in {f.code for f in errors}, errors
    assert all(f.fix for f in errors if f.code == code)


@pytest.mark.parametrize("extra", GOOD, ids=[" ".join(a) or "defaults" for a in GOOD])
def test_good_config_stays_clean(mimo7b, extra):
    errors, findings = errors_of(mimo7b, extra)
    assert errors == []
    assert all(f.level != "warning" or f.code == "UNKNOWN_FLAG" for f in findings), findings


def test_range_finding_names_flag_value_and_fix():
    values = flag_checks.derived_values({**dict.fromkeys(b.name for b in flag_checks.BOUNDS),
                                         "rollout_top_p": 5.0, "actor_num_nodes": 1, "actor_num_gpus_per_node": 1,
                                         "tensor_model_parallel_size": 1, "micro_batch_size": 1,
                                         "global_batch_size": None, "rollout_batch_size": 1,
                                         "n_samples_per_prompt": 1, "backend": "embedded",
                                         "rollout_num_gpus_per_engine": 1, "rollout_num_gpus": None})
    [f] = flag_checks.check(values)
    assert (f.code, f.message, f.fix) == ("FLAG_OUT_OF_RANGE", "--rollout-top-p 5.0: must be in (0, 1]",
                                          "--rollout-top-p 1.0 (no nucleus cut)")


def test_tp_relation_message(mimo7b):
    errors, _ = errors_of(mimo7b, ["--tensor-model-parallel-size", "2"])
    [f] = errors
    assert "1 actor GPU(s)" in f.message and "--tensor-model-parallel-size 2" in f.message


def test_refused_flags_name_what_to_use(mimo7b):
    errors, _ = errors_of(mimo7b, ["--rollout-function-path", "my.fn", "--rm-url", "http://rm:8000",
                                   "--custom-loss-function-path", "my.loss"])
    by_flag = {f.message.split(" ", 1)[0]: f for f in errors}
    assert "--custom-generate-function-path" in by_flag["--rollout-function-path"].fix
    assert "--custom-rm-path" in by_flag["--rm-url"].fix
    assert "--loss-type" in by_flag["--custom-loss-function-path"].fix


def test_unknown_flag_error_names_closest(mimo7b):
    errors, _ = errors_of(mimo7b, ["--rollout-batch-sise", "4"])
    assert "did you mean --rollout-batch-size?" in errors[0].message


def test_gpu_comparison():
    assert compare_gpus(0, "", None, 0, launching=True) == []
    assert compare_gpus(4, "actor 2 + rollout 2", 8.0, 0, launching=True) == []
    [f] = compare_gpus(9, "actor 1 + rollout 8", 8.0, 0, launching=False)
    assert f.code == "GPUS_UNAVAILABLE" and "the Ray cluster has 8" in f.message
    [f] = compare_gpus(2, "actor 1 + rollout 1", None, 0, launching=True)
    assert f.code == "GPUS_UNAVAILABLE" and f.level == "error" and "has none" in f.message
    [f] = compare_gpus(2, "actor 1 + rollout 1", None, 0, launching=False)
    assert f.code == "GPUS_NOT_CHECKED" and f.level == "info"
    assert compare_gpus(2, "", None, 2, launching=True) == []


def test_sglang_backend_without_gpus_stops_a_launch(mimo7b, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    import ray._private.services

    monkeypatch.setattr(ray._private.services, "find_gcs_addresses", lambda: [])
    monkeypatch.setattr("slime_spec.cluster.gpu_check.local_gpus", lambda: 0)
    parsed = parse(["--hf-checkpoint", str(mimo7b), "--rollout-backend", "sglang"])
    _, findings = diagnose(parsed, launching=True)
    assert "GPUS_UNAVAILABLE" in {f.code for f in findings if f.level == "error"}
    _, findings = diagnose(parsed, launching=False)
    assert "GPUS_NOT_CHECKED" in {f.code for f in findings}


@pytest.fixture(scope="module")
def qwen3_moe_ckpt(tmp_path_factory):
    from slime_spec.tools.tiny_model import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", hidden_size=32, num_experts=4)


def test_expert_parallel_is_acted_on_where_it_fits(qwen3_moe_ckpt):
    errors, findings = errors_of(qwen3_moe_ckpt, ["--actor-num-gpus-per-node", "2", "--expert-model-parallel-size",
                                                  "2", "--expert-tensor-parallel-size", "1", "--use-dynamic-batch-size",
                                                  "--max-tokens-per-gpu", "512"])
    assert errors == []
    assert not any("--expert-model-parallel-size" in f.message for f in findings), findings  # not "ignored"


@pytest.mark.parametrize("extra,says", [
    (["--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "4"],
     "2 actor GPU(s) are not divisible by expert tensor parallel size 1 x --expert-model-parallel-size 4 x "
     "--pipeline-model-parallel-size 1"),
    (["--actor-num-gpus-per-node", "3", "--expert-model-parallel-size", "3", "--global-batch-size", "3"],
     "--expert-model-parallel-size 3 with a qwen3_moe model: each expert-parallel rank holds an equal share of "
     "the 4 routed experts"),
    (["--expert-model-parallel-size", "0"], "--expert-model-parallel-size 0: must be >= 1"),
])
def test_expert_parallel_misfits_name_the_flag_and_fix(qwen3_moe_ckpt, extra, says):
    errors, _ = errors_of(qwen3_moe_ckpt, extra)
    hits = [f for f in errors if says in f.message]
    assert hits and all("--expert-model-parallel-size" in f.fix for f in hits), errors


def test_expert_parallel_on_a_dense_model_or_with_tensor_parallel_is_refused(mimo7b, qwen3_moe_ckpt):
    errors, _ = errors_of(mimo7b, ["--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2",
                                   "--global-batch-size", "2"])
    assert [f.fix for f in errors if "has no experts to split" in f.message] == ["--expert-model-parallel-size 1"]
    tp_ep = ["--actor-num-gpus-per-node", "4", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    [f] = errors_of(qwen3_moe_ckpt, tp_ep)[0]  # each expert split over TP as well: not built
    assert (f.code, f.message.split(":")[0]) == ("TRAINER_UNSUPPORTED_MODEL", "the experts of a qwen3_moe model")
    assert "add --expert-tensor-parallel-size 1" in f.message
    assert errors_of(qwen3_moe_ckpt, [*tp_ep, "--expert-tensor-parallel-size", "1"])[0] == []  # whole experts: built
    [f] = errors_of(qwen3_moe_ckpt, ["--actor-num-gpus-per-node", "4", "--expert-model-parallel-size", "2",
                                     "--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"])[0]
    assert "use --expert-model-parallel-size 4" in f.message  # an EP group holds whole TP groups


def test_moe_under_tensor_parallel_is_built_where_it_trains_as_at_tp1(qwen3_moe_ckpt):
    from slime_spec.doctor.spec_checks import CheckInput, check_trainer_support

    errors, _ = errors_of(qwen3_moe_ckpt, ["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
                                           "--sequence-parallel"])
    assert errors == []  # sequence parallelism under TP (trainer/sequence_parallel.py)
    qwen3_moe = json.loads((qwen3_moe_ckpt / "config.json").read_text())
    inp = dict(sglang={}, backend="embedded", sglang_version="0.5.23", tensor_model_parallel_size=2)
    # an online EAGLE3 draft reads the whole sequence's aux states (tests/test_trainer_tp.py)
    assert check_trainer_support(CheckInput(**inp, target_config=qwen3_moe, enable_draft_training=True)) == []
    for family, arch in (("glm4_moe", "Glm4MoeForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM")):
        config = {"model_type": family, "architectures": [arch]}  # with its MTP layer
        assert check_trainer_support(CheckInput(**inp, target_config=config, mtp_num_layers=1)) == []
