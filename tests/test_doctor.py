import json

from slime_spec.doctor.diagnose import main
from tests.test_args import sglang_args_of


def run(capsys, *argv):
    rc = main([*argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def test_json_shape_and_eagle3_example_is_clean(capsys, llama8b, eagle3_draft):
    example = sglang_args_of("sglang-args-eagle3-llama3.1-8B.sh")
    tokens = [str(eagle3_draft) if t.startswith("/root/") else t for t in example]
    rc, out = run(capsys, "--hf-checkpoint", str(llama8b), "--rollout-backend", "sglang", *tokens)
    assert rc == 0, out["findings"]
    assert set(out) == {"sglang_version", "findings", "engines"} and out["sglang_version"] == "0.5.23"
    # The example gives no CUDA-graph batch list: the one warning it deserves, and no error.
    assert [f["code"] for f in out["findings"] if f["level"] != "info"] == ["SPEC_CUDA_GRAPH_BS"]
    assert out["engines"][0]["backend"] == "sglang" and out["engines"][0]["argv"][2] == "sglang.launch_server"


def test_errors_exit_2_with_code_message_fix(capsys, llama8b, eagle3_draft):
    rc, out = run(capsys, "--hf-checkpoint", str(llama8b), "--rollout-backend", "sglang",
                  "--sglang-speculative-algorithm", "EAGLE3",
                  "--sglang-speculative-draft-model-path", str(eagle3_draft))
    assert rc == 2
    by_code = {f["code"]: f for f in out["findings"]}
    assert by_code["SPEC_DTYPE_MISMATCH"]["fix"] == "--sglang-dtype float16"
    assert by_code["SPEC_CONTEXT_LENGTH"]["level"] == "error"


def test_missing_config_json_is_a_finding_not_a_traceback(capsys, tmp_path):
    rc, out = run(capsys, "--hf-checkpoint", str(tmp_path / "nope"), "--sglang-speculative-algorithm", "NGRAM")
    assert rc == 2
    f = next(f for f in out["findings"] if f["code"] == "CONFIG_UNREADABLE")
    assert str(tmp_path / "nope" / "config.json") in f["message"]


def test_unknown_sglang_flag_and_unhonoured_flags(capsys, mimo7b):
    rc, out = run(capsys, "--hf-checkpoint", str(mimo7b), "--sglang-speculative-eagle-top-k", "1")
    assert rc == 2 and "did you mean --sglang-speculative-eagle-topk" in out["findings"][0]["message"]
    rc, out = run(capsys, "--hf-checkpoint", str(mimo7b), "--recompute-granularity", "full", "--num-layers", "36",
                  "--hidden-size", "4096", "--rollout-backend", "embedded")
    assert rc == 0
    infos = {f["code"] for f in out["findings"]}
    assert "FLAG_NOT_HONOURED" in infos
    rc, out = run(capsys, "--hf-checkpoint", str(mimo7b), "--num-layers", "30")
    assert rc == 2 and any(f["code"] == "MODEL_ARGS_MISMATCH" for f in out["findings"])


def test_text_output(capsys, mimo7b):
    rc = main(["--hf-checkpoint", str(mimo7b), "--sglang-speculative-algorithm", "NEXTN",
               "--rollout-backend", "embedded"])
    out = capsys.readouterr().out
    assert rc == 0 and "engine 0 (embedded" in out and "slime_spec.engine" in out and "0 error(s)" in out


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0
    assert "--sglang-<flag>" in capsys.readouterr().out


def test_embedded_backend_refusals_are_found_before_launch(capsys, mimo7b):
    rc, out = run(capsys, "--hf-checkpoint", str(mimo7b), "--rollout-backend", "embedded",
                  "--sglang-quantization", "fp8", "--sglang-mem-fraction-static", "0.7")
    f = next(f for f in out["findings"] if f["code"] == "EMBEDDED_FLAG_REFUSED")
    assert rc == 2 and "--sglang-quantization='fp8'" in f["message"] and "mem-fraction" not in f["message"]
    rc, out = run(capsys, "--hf-checkpoint", str(mimo7b), "--rollout-backend", "sglang", "--sglang-quantization", "fp8")
    assert "EMBEDDED_FLAG_REFUSED" not in {f["code"] for f in out["findings"]}


def test_embedded_memory_saver_is_refused_where_it_cannot_run(capsys, mimo7b, monkeypatch):
    from slime_spec.engine.model_executor import memory_saver
    monkeypatch.setattr(memory_saver.importlib.util, "find_spec", lambda name: None)
    rc, out = run(capsys, "--hf-checkpoint", str(mimo7b), "--rollout-backend", "embedded",
                  "--sglang-enable-memory-saver")
    f = next(f for f in out["findings"] if f["code"] == "EMBEDDED_FLAG_REFUSED")
    assert rc == 2 and "pip install torch_memory_saver" in f["message"]
    rc, out = run(capsys, "--hf-checkpoint", str(mimo7b), "--rollout-backend", "embedded",
                  "--sglang-enable-memory-saver", "--sglang-device", "cpu")
    assert "--sglang-enable-memory-saver needs a CUDA device" in next(
        f for f in out["findings"] if f["code"] == "EMBEDDED_FLAG_REFUSED")["message"]


def test_flags_that_change_nothing_read_as_one_line_per_reason(capsys, mimo7b):
    rc, out = run(capsys, "--hf-checkpoint", str(mimo7b), "--rollout-backend", "embedded", "--recompute-granularity",
                  "full", "--recompute-method", "uniform", "--sequence-parallel", "--attention-dropout", "0.0",
                  "--pipeline-model-parallel-size", "1", "--no-rope-fusion")
    assert rc == 0
    lines = [f["message"] for f in out["findings"] if f["code"] == "FLAG_NOT_HONOURED"]
    assert len(lines) == 2, lines
    knobs = next(m for m in lines if "Megatron memory/speed knob" in m)
    assert knobs.endswith("--no-rope-fusion, --recompute-granularity, --recompute-method, --sequence-parallel")
    assert any(m.endswith("--attention-dropout 0.0") for m in lines)  # PP 1 is acted on: no line of its own


def test_balance_data_is_refused_only_where_nothing_balances_by_tokens(capsys, mimo7b):
    two_ranks = ["--hf-checkpoint", str(mimo7b), "--rollout-backend", "embedded", "--actor-num-gpus-per-node", "2",
                 "--balance-data", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
    rc, out = run(capsys, *two_ranks)
    assert rc == 2 and [f["fix"] for f in out["findings"] if f["code"] == "FLAG_NOT_SUPPORTED"] == [
        "add --max-tokens-per-gpu N (packed micro-batches; each step's samples balanced by tokens over the "
        "data-parallel ranks)"]
    for enough in (["--max-tokens-per-gpu", "4096"], ["--actor-num-gpus-per-node", "1"]):
        rc, out = run(capsys, *two_ranks, *enough)
        assert not [f for f in out["findings"] if f["level"] == "error"], out["findings"]


def test_ref_load_must_be_readable_by_the_trainer(capsys, mimo7b, tmp_path):
    base = ["--hf-checkpoint", str(mimo7b), "--rollout-backend", "embedded", "--use-kl-loss"]
    rc, out = run(capsys, *base, "--ref-load", str(tmp_path / "nope"))
    unreadable = next(f for f in out["findings"] if f["code"] == "REF_LOAD_UNREADABLE")
    assert rc == 2 and "does not exist" in unreadable["message"]
    torch_dist = tmp_path / "Model_torch_dist"
    (torch_dist / "iter_0000000").mkdir(parents=True)
    (torch_dist / "latest_checkpointed_iteration.txt").write_text("release")
    rc, out = run(capsys, *base, "--ref-load", str(torch_dist))
    assert rc == 2 and "Megatron (torch_dist)" in next(
        f for f in out["findings"] if f["code"] == "REF_LOAD_UNREADABLE")["message"]
    rc, out = run(capsys, *base, "--ref-load", str(mimo7b))
    assert rc == 0
