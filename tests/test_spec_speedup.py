"""The speed-up measurement's pure parts: the plain engine's flags, when it runs, what it reports, what it refuses,
how a timed half sends its prompts."""

import asyncio
import gc

import pytest

from slime_spec.config.args import parse_config
from slime_spec.fleet.client import AsyncEngineClient, EngineAuth
from slime_spec.speculative.speedup import (
    TimedHalf,
    check_config,
    collector_paused,
    due,
    half_order,
    median_half,
    plain_engine_config,
    speedup_metrics,
    time_generation,
    without_speculative_flags,
)

SPEC = ["--sglang-speculative-algorithm", "NEXTN", "--sglang-speculative-num-steps", "2",
        "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "3"]


def config(*extra):
    return parse_config(["--hf-checkpoint", "/m", "--rollout-backend", "embedded", *extra])[0]


def test_plain_engine_drops_every_speculative_flag_and_keeps_the_rest():
    argv = ("--speculative-algorithm", "NEXTN", "--mem-fraction-static", "0.5", "--speculative-num-steps", "2",
            "--speculative-adaptive", "--max-running-requests", "8")
    assert without_speculative_flags(argv) == ("--mem-fraction-static", "0.5", "--max-running-requests", "8")
    engine = plain_engine_config(config(*SPEC, "--sglang-max-running-requests", "8").engine)
    assert not any(t.startswith("--speculative") for t in engine.forwarded_argv)
    assert "--max-running-requests" in engine.forwarded_argv
    assert not any(k.startswith("speculative_") for k in engine.server_args)


def running_limit(argv: list[str]) -> int | None:
    return int(argv[argv.index("--max-running-requests") + 1]) if "--max-running-requests" in argv else None


def test_the_plain_engine_runs_the_whole_rollout_at_once_as_sglang_would():
    """Unset, SGLang runs every request its KV pool holds without speculation, 48 with it: the plain engine (and
    any plain embedded engine) is sized to the rollout's in-flight requests, the speculative one left to the
    engine's SGLang default; a limit the user set reaches both as written."""
    batch = ["--rollout-batch-size", "16", "--n-samples-per-prompt", "8"]
    spec = config(*SPEC, *batch).engine
    assert running_limit(spec.server_argv("h", 1)) is None  # the engine resets it to 48, as SGLang
    assert running_limit(plain_engine_config(spec).server_argv("h", 1)) == 128
    assert running_limit(config(*batch).engine.server_argv("h", 1)) == 128
    assert running_limit(config(*batch, "--sglang-server-concurrency", "64").engine.server_argv("h", 1)) == 64
    assert running_limit(config(*batch, "--rollout-num-engines", "3").engine.server_argv("h", 1)) == 43  # 128 / 3
    mine = config(*SPEC, *batch, "--sglang-max-running-requests", "96").engine
    assert running_limit(mine.server_argv("h", 1)) == running_limit(plain_engine_config(mine).server_argv("h", 1)) \
        == 96
    on_sglang = parse_config(["--hf-checkpoint", "/m", "--rollout-backend", "sglang", *batch])[0].engine
    assert running_limit(on_sglang.server_argv("h", 1)) is None  # SGLang sizes its own from its KV pool


def test_plain_engine_drops_our_own_speculative_options():
    """The plain server refuses --spec-auto / --spec-draft-sampling without speculation."""
    spec = config(*SPEC, "--spec-auto", "--spec-draft-sampling").engine
    assert {"--spec-auto", "--spec-draft-sampling"} <= set(spec.server_argv("127.0.0.1", 1))
    plain = plain_engine_config(spec).server_argv("127.0.0.1", 1)
    assert not any(t.startswith("--spec") for t in plain)


def test_measures_the_first_rollout_every_nth_and_the_last():
    assert [r for r in range(10) if due(4, r, 10)] == [0, 3, 7, 9]  # the first: the baseline
    assert [r for r in range(5, 10) if due(4, r, 10, first_rollout=5)] == [5, 7, 9]  # resumed at rollout 5
    assert not any(due(None, r, 10) for r in range(10))


def test_speedup_is_plain_time_over_speculative_time():
    m = speedup_metrics(TimedHalf(2.0, 400, 160), TimedHalf(3.0, 420, 0), spec_first=True)
    assert m["spec_speedup"] == pytest.approx(1.5)
    assert m["spec_speedup_tokens_per_s"] == pytest.approx((400 / 2.0) / (420 / 3.0))
    assert m["spec_speedup_accept_length"] == pytest.approx(2.5)
    assert (m["spec_speedup_spec_tokens"], m["spec_speedup_plain_tokens"]) == (400, 420)
    assert m["spec_speedup_accept_rate"] is None and "spec_speedup_frozen" not in m  # no counters, no frozen half


def test_the_frozen_draft_is_timed_against_the_same_plain_half():
    m = speedup_metrics(TimedHalf(2.0, 400, 160, accepted=216, drafted=240), TimedHalf(3.0, 420, 0), True,
                        frozen=TimedHalf(2.5, 410, 205, accepted=190, drafted=250))
    assert m["spec_speedup"] == pytest.approx(1.5) and m["spec_speedup_frozen"] == pytest.approx(1.2)
    assert m["spec_speedup_accept_rate"] == pytest.approx(0.9) and m["spec_speedup_frozen_accept_rate"] == 0.76
    assert m["spec_speedup_frozen_accept_length"] == pytest.approx(2.0)
    assert (m["spec_speedup_frozen_s"], m["spec_speedup_frozen_tokens"]) == (2.5, 410)


def test_repeated_passes_take_each_engines_median_time_and_every_passs_counters():
    """--spec-speedup-repeats 3: a pass the machine slowed (9.0 s) does not move the engine's time."""
    spec = median_half([TimedHalf(2.0, 400, 160, 216, 240), TimedHalf(9.0, 410, 164, 220, 246),
                        TimedHalf(2.2, 390, 156, 210, 234)])
    plain = median_half([TimedHalf(3.0, 420, 0), TimedHalf(3.3, 400, 0), TimedHalf(2.9, 410, 0)])
    assert (spec.seconds, spec.passes, spec.response_tokens) == (2.2, 3, 1200)
    m = speedup_metrics(spec, plain, spec_first=False)
    assert m["spec_speedup"] == pytest.approx(3.0 / 2.2) and m["spec_speedup_passes"] == 3
    assert m["spec_speedup_spec_tokens"] == 400 and m["spec_speedup_plain_tokens"] == 410  # per pass
    assert m["spec_speedup_tokens_per_s"] == pytest.approx((400 / 2.2) / (410 / 3.0))
    assert m["spec_speedup_accept_length"] == pytest.approx(1200 / 480)
    assert m["spec_speedup_accept_rate"] == pytest.approx(646 / 720)


def test_halves_rotate_so_none_always_runs_first():
    assert [half_order(i, frozen=True) for i in range(4)] == [
        ("spec", "plain", "frozen"), ("plain", "frozen", "spec"), ("frozen", "spec", "plain"),
        ("spec", "plain", "frozen")]
    assert [half_order(i, frozen=False) for i in range(3)] == [("spec", "plain"), ("plain", "spec"),
                                                               ("spec", "plain")]


@pytest.mark.parametrize("extra, match", [
    (["--spec-speedup-interval", "0", *SPEC], "must be >= 1"),
    (["--spec-speedup-interval", "2"], "no --sglang-speculative-algorithm"),
    (["--spec-speedup-interval", "2", "--debug-rollout-only", *SPEC], "--debug-rollout-only"),
    (["--spec-speedup-frozen-draft", "--enable-mtp-training", *SPEC], "set --spec-speedup-interval"),
    (["--spec-speedup-interval", "2", "--spec-speedup-frozen-draft", *SPEC], "frozen already"),
    (["--spec-speedup-repeats", "3", *SPEC], "--spec-speedup-repeats is part of the speed-up measurement"),
    (["--spec-speedup-interval", "2", "--spec-speedup-repeats", "0", *SPEC], "--spec-speedup-repeats=0"),
])
def test_refuses_what_it_cannot_measure(extra, match):
    with pytest.raises(ValueError, match=match):
        check_config(config(*extra))


def test_refuses_sglang_backend():
    c = parse_config(["--hf-checkpoint", "/m", "--rollout-backend", "sglang", "--spec-speedup-interval", "2",
                      *SPEC])[0]
    with pytest.raises(ValueError, match="--rollout-backend embedded"):
        check_config(c)
    check_config(config("--spec-speedup-interval", "2", *SPEC))
    check_config(config("--spec-speedup-interval", "2", "--spec-speedup-frozen-draft", "--enable-mtp-training",
                        *SPEC))  # the demo's setting passes


def test_a_timed_half_runs_with_the_collector_off_and_leaves_it_as_it_was():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # off before: still off
    finally:
        gc.enable()


class RecordingClient:
    """Test double for fleet.client.EngineClient: records what is posted, answers success as SGLang does."""

    def __init__(self):
        self.posted = []

    def post(self, path, payload):
        self.posted.append((path, payload))
        return {"success": True, "message": "Succeeded to update model weights."}


def test_the_probe_engines_of_an_fp8_checkpoint_load_what_the_sync_sends(tmp_path):
    """Plain and frozen-draft engines load the trainer's weights from disk; for an FP8 checkpoint quantized with their
    scales, as the sync sends them to the speculative engine, so all three serve the same values."""
    import torch
    from safetensors.torch import load_file

    from slime_spec.speculative.speedup import SpeedupProbe
    from slime_spec.weight_sync import fp8
    probe = SpeedupProbe.__new__(SpeedupProbe)  # its engines are not started: only the weights' way is asked
    probe.dir, probe.weights_dir = tmp_path, tmp_path / "weights"
    probe.is_mtp = lambda name: name.startswith("model.layers.2.")
    probe.fp8 = fp8.Fp8BlockScheme.from_hf_config({"quantization_config": fp8.DEEPSEEK_V3_FP8})
    probe.clients = {"plain": RecordingClient()}
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    weights = {o_proj: torch.randn(128, 128), "model.norm.weight": torch.ones(128),
               "model.layers.2.eh_proj.weight": torch.ones(2, 2)}
    probe.load_weights(weights, "3")
    saved = load_file(str(probe.weights_dir / "model.safetensors"))
    assert sorted(saved) == sorted([o_proj, o_proj + fp8.SCALE_SUFFIX, "model.norm.weight"])
    q, s = fp8.quantize(weights[o_proj], probe.fp8.block)
    assert torch.equal(saved[o_proj].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(saved[o_proj + fp8.SCALE_SUFFIX], s)
    assert probe.clients["plain"].posted == [("/update_weights_from_disk", {"model_path": str(probe.weights_dir),
                                                                            "weight_version": "3"})]


def test_a_timed_half_sends_the_prompts_as_the_rollout_sends_them(monkeypatch):
    """A group of several as one batched /generate (the default generate function's groups), else one request per
    prompt (a custom generate function, the sglang-router, history drafting: rollout/generate.py sends_groups)."""
    sent = []
    meta = {"meta_info": {"completion_tokens": 2, "spec_verify_ct": 1}}

    async def generate(self, payload):
        sent.append(("one", payload["input_ids"]))
        return meta

    async def generate_batch(self, payload):
        sent.append(("batch", payload["input_ids"]))
        return [meta] * len(payload["input_ids"])

    monkeypatch.setattr(AsyncEngineClient, "generate", generate)
    monkeypatch.setattr(AsyncEngineClient, "generate_batch", generate_batch)
    groups = [[[1], [1]], [[2]]]
    for batched, expected in ((True, [("batch", [[1], [1]]), ("one", [2])]),
                              (False, [("one", [1]), ("one", [1]), ("one", [2])])):
        sent.clear()
        half = asyncio.run(time_generation("http://127.0.0.1:9", EngineAuth(), groups, {"max_new_tokens": 2}, 8, 5,
                                           batched=batched))
        assert sorted(sent) == expected and half.response_tokens == 6 and half.verify_ct == 3
