"""The embedded server's flag handling: SGLang's parser, the honoured/ignored/refused table, resolution."""

import dataclasses

import pytest

from slime_spec.engine.server_args import (
    IMPLEMENTED,
    PERFORMANCE_ONLY,
    REFUSAL_REASONS,
    ServerArgsError,
    classify_flags,
    defaults_of,
    option_names,
    parse_server_args,
    resolve_device,
    resolve_dtype,
    sglang_parser,
)
from slime_spec.speculative.settings import SpecConfig
from slime_spec.tools.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def parser():
    return sglang_parser()


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("mimo"), arch="mimo", hidden_size=32, num_layers=1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", hidden_size=32, num_layers=1)


def test_every_table_entry_is_a_real_sglang_flag(parser):
    dests = set(defaults_of(parser))
    for table in (IMPLEMENTED, PERFORMANCE_ONLY, set(REFUSAL_REASONS)):
        assert table - dests == set()


def test_classify_sorts_non_default_flags():
    defaults = {"model_path": None, "mem_fraction_static": None, "chunked_prefill_size": None,
                "quantization": None, "tp_size": 1, "speculative_token_map": None, "schedule_policy": "fcfs"}
    names = {d: "--" + d.replace("_", "-") for d in defaults}
    values = {**defaults, "model_path": "/m", "mem_fraction_static": 0.7, "chunked_prefill_size": 512,
              "quantization": "fp8", "speculative_token_map": "map.pt"}
    report = classify_flags(values, defaults, names)
    assert report.ignored == ("--mem-fraction-static=0.7", "--chunked-prefill-size=512")
    assert [r.split(":")[0] for r in report.refused] == ["--quantization='fp8'", "--speculative-token-map='map.pt'"]
    assert "quantized weights change the logits" in report.refused[0]
    assert classify_flags(defaults, defaults, names).refused == ()


def test_tp_size_must_be_one_and_unknown_flags_are_refused():
    defaults = {"tp_size": 1, "enable_mixed_precision_magic": False}
    report = classify_flags({"tp_size": 2, "enable_mixed_precision_magic": True}, defaults, {})
    assert "use --tp-size 1" in report.refused[0]
    assert "not implemented by the embedded engine" in report.refused[1]


def test_resolve_dtype_and_device():
    assert resolve_dtype("auto", "cpu", "bfloat16") == "float32"
    assert resolve_dtype("auto", "cuda", "float32") == "float16"
    assert resolve_dtype("auto", "cuda", "bfloat16") == "bfloat16"
    assert resolve_dtype("half", "cpu", None) == "float16"
    assert resolve_device(None, cuda_available=False) == "cpu"
    assert resolve_device(None, cuda_available=True) == "cuda"
    with pytest.raises(ServerArgsError, match="no CUDA device"):
        resolve_device("cuda", cuda_available=False)


def test_parse_server_args(mimo, parser):
    args = parse_server_args(["--model-path", str(mimo), "--port", "1234", "--api-key", "k", "--speculative-algorithm",
                              "NEXTN", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
                              "--speculative-num-draft-tokens", "3", "--mem-fraction-static", "0.6",
                              "--random-seed", "7"], cuda_available=False)
    assert (args.host, args.port, args.device, args.dtype, args.random_seed) == ("127.0.0.1", 1234, "cpu", "float32", 7)
    spec = args.spec  # NEXTN is SGLang's alias of EAGLE
    assert (spec.speculative_algorithm, spec.speculative_num_steps,
            spec.speculative_num_draft_tokens) == ("EAGLE", 2, 3)
    assert args.api_key == "k" and "api_key" not in args.sglang_args
    assert args.ignored_flags == ("--mem-fraction-static=0.6",)
    assert option_names(parser)["speculative_draft_model_path"] == "--speculative-draft-model-path"
    same = parse_server_args(["--model-path", str(mimo), "--speculative-algorithm", "EAGLE",
                              "--speculative-draft-model", str(mimo)], cuda_available=False)
    assert same.spec.speculative_draft_model_path is None  # the target's own MTP layers, named by path
    assert same.sglang_args["speculative_draft_model_path"] == str(mimo)  # as the user wrote it


def test_parse_refuses_result_changing_flags_all_at_once(mimo):
    with pytest.raises(ServerArgsError) as e:
        parse_server_args(["--model-path", str(mimo), "--tp-size", "2", "--speculative-accept-threshold-single", "0.5",
                           "--enable-lora", "--tokenizer-path", "/elsewhere"], cuda_available=False)
    text = str(e.value)
    for flag in ("--tp-size=2", "--speculative-accept-threshold-single=0.5", "--enable-lora=True",
                 "--tokenizer-path='/elsewhere'"):
        assert flag in text
    with pytest.raises(ServerArgsError, match="no config.json"):
        parse_server_args(["--model-path", str(mimo / "missing")], cuda_available=False)


def test_engine_refuses_what_it_cannot_draft(llama, mimo):
    from slime_spec.engine.managers.scheduler import EngineLoop
    from slime_spec.engine.managers.scheduler_process import make_core_factory
    # A tree larger than SGLang allows (num_draft_tokens <= topk + (steps - 1) * topk^2 + 1) is refused while
    # parsing the flags (spec.resolve), before a model loads.
    with pytest.raises(ServerArgsError, match="SPEC_TOPK_TOKENS"):
        parse_server_args(["--model-path", str(llama), "--speculative-algorithm", "STANDALONE",
                           "--speculative-draft-model-path", str(llama), "--speculative-num-steps", "2",
                           "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"],
                          cuda_available=False)
    with pytest.raises(ServerArgsError, match="SPEC_EAGLE3_NO_DRAFT"):
        parse_server_args(["--model-path", str(mimo), "--speculative-algorithm", "EAGLE3"], cuda_available=False)
    # A SpecConfig that did not come from spec.resolve is checked again by the engine at start.
    args = parse_server_args(["--model-path", str(mimo)], cuda_available=False)
    for bad, code in ((SpecConfig("FROZEN_KV_MTP", 3, 1, 4, str(mimo)), "SPEC_UNSUPPORTED_BY_BACKEND"),
                      (SpecConfig("EAGLE", 2, 2, 8), "SPEC_TOPK_TOKENS")):
        with pytest.raises(ValueError, match=code):
            EngineLoop(make_core_factory(dataclasses.replace(args, spec=bad))).start()


def test_server_refuses_to_start_with_a_harmful_flag(mimo, capsys):
    from slime_spec.engine.__main__ import main
    assert main(["--model-path", str(mimo), "--port", "1", "--quantization", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "--quantization='fp8'" in err and "change the logits" in err
    assert main(["--model-path", str(mimo), "--port", "1", "--speculative-algorithm", "EAGLE3"]) == 2
    assert "SPEC_EAGLE3_NO_DRAFT" in capsys.readouterr().err


def test_own_speculative_flags_parse_and_are_checked(tmp_path):
    from slime_spec.tools.tiny_model import make_tiny_model
    model = str(make_tiny_model(tmp_path / "m", arch="mimo", hidden_size=32, num_layers=1))
    args = parse_server_args(["--model-path", model, "--speculative-algorithm", "NEXTN", "--spec-draft-sampling",
                              "--spec-auto"], cuda_available=False)
    assert args.spec_draft_sampling and args.spec_auto and not args.ignored_flags
    assert not parse_server_args(["--model-path", model], cuda_available=False).spec_auto
    with pytest.raises(ServerArgsError, match="--spec-auto needs speculative decoding"):
        parse_server_args(["--model-path", model, "--spec-auto"], cuda_available=False)
    with pytest.raises(ServerArgsError, match="keep one"):
        parse_server_args(["--model-path", model, "--speculative-algorithm", "EAGLE", "--speculative-adaptive",
                           "--spec-auto"], cuda_available=False)


def test_own_flags_travel_from_the_slime_command_line_to_the_embedded_server(tmp_path):
    from slime_spec.config.args import parse_config
    from slime_spec.tools.tiny_model import make_tiny_model
    model = str(make_tiny_model(tmp_path / "m", arch="mimo", hidden_size=32, num_layers=1))
    flags = ["--hf-checkpoint", model, "--sglang-speculative-algorithm", "NEXTN", "--spec-auto",
             "--spec-draft-sampling"]
    embedded, _ = parse_config([*flags, "--rollout-backend", "embedded"])
    argv = embedded.engine.server_argv("127.0.0.1", 30000)
    assert argv[-2:] == ["--spec-draft-sampling", "--spec-auto"]
    served = parse_server_args(argv[argv.index("--model-path"):], cuda_available=False)
    assert served.spec_auto and served.spec_draft_sampling
    sglang, _ = parse_config([*flags, "--rollout-backend", "sglang"])
    assert "--spec-auto" not in sglang.engine.server_argv("127.0.0.1", 30000)  # doctor refuses it there


def test_cuda_graph_flags_are_honoured_with_sglangs_capture_list(tmp_path):
    """SGLang's graph flags are implemented (not ignored): parsed into CudaGraphSettings, and the default
    capture list is SGLang's decode list clamped to --max-running-requests."""
    from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings
    from slime_spec.tools.tiny_model import make_tiny_model
    model = make_tiny_model(tmp_path / "m", arch="llama", mtp_layers=0, hidden_size=32, num_layers=1)
    args = parse_server_args(["--model-path", str(model), "--cuda-graph-max-bs-decode", "6",
                              "--cuda-graph-bs-decode", "1", "2", "3", "--disable-cuda-graph"], cuda_available=False)
    assert args.cuda_graph == CudaGraphSettings(disable=True, batch_sizes=(1, 2, 3), max_bs=6)
    assert not any("cuda-graph" in f for f in args.ignored_flags)
    assert CudaGraphSettings(max_bs=12).capture_sizes(8, speculative=True) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert CudaGraphSettings().capture_sizes(48, speculative=False) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48]


def test_disable_overlap_schedule_is_honoured(tmp_path):
    """SGLang's --disable-overlap-schedule turns the embedded engine's overlap schedule off
    (engine/managers/overlap.py);
    without it the engine picks its default (on for plain decoding on CUDA)."""
    from slime_spec.tools.tiny_model import make_tiny_model
    model = make_tiny_model(tmp_path / "m", arch="llama", mtp_layers=0, hidden_size=32, num_layers=1)
    args = parse_server_args(["--model-path", str(model), "--disable-overlap-schedule"], cuda_available=False)
    assert args.overlap_schedule is False and "--disable-overlap-schedule" not in args.ignored_flags
    assert parse_server_args(["--model-path", str(model)], cuda_available=False).overlap_schedule is None


def test_gc_threshold_is_honoured_and_checked(mimo):
    args = parse_server_args(["--model-path", str(mimo), "--gc-threshold", "7000", "20", "20"])
    assert args.gc_threshold == (7000, 20, 20) and not args.ignored_flags
    assert parse_server_args(["--model-path", str(mimo)]).gc_threshold is None
    with pytest.raises(ServerArgsError, match="--gc-threshold=1 2 3 4: give 1 to 3"):
        parse_server_args(["--model-path", str(mimo), "--gc-threshold", "1", "2", "3", "4"])


@pytest.mark.parametrize("given", [[], ["--dtype", "auto"], ["--dtype=auto"]])
def test_sglang_argv_names_the_served_dtype(tmp_path, given):
    """SGLang's /server_info reports `dtype` as launched; the engine's 'auto' is resolved first (float32 on CPU, for
    a bfloat16 checkpoint too), so a trainer reading it hashes the bytes the engine serves."""
    from slime_spec.engine.server_args import sglang_argv
    model = make_tiny_model(tmp_path / "m", arch="llama", hidden_size=32, num_layers=1, dtype="bfloat16")
    argv = ["--model-path", str(model), *given]
    out = sglang_argv(argv, parse_server_args(argv, cuda_available=False))
    assert out[-2:] == ["--dtype", "float32"] and "auto" not in out and not any(a.startswith("--dtype=") for a in out)


def test_memory_saver_is_refused_on_cpu_before_sglangs_launcher_preloads_it(mimo):
    with pytest.raises(ServerArgsError, match="--enable-memory-saver needs a CUDA device"):
        parse_server_args(["--model-path", str(mimo), "--enable-memory-saver"], cuda_available=False)
    assert parse_server_args(["--model-path", str(mimo)], cuda_available=False).memory_saver is False
