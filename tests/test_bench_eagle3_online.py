"""bench/eagle3_online.py's pieces that run in seconds: the trend verdict and the two GRPO runs' flags (the whole
20-step comparison is the bench itself)."""

import pytest

from bench import eagle3_online
from slime_spec.config.args import parse
from slime_spec.demo.task import split_problems, write_jsonl
from slime_spec.tools.tiny_model import make_tiny_eagle3_draft


def run(first: float, last: float) -> dict:
    return {"accept_length_first_quarter_mean": first, "accept_length_last_quarter_mean": last}


def test_trend_needs_more_than_the_tolerance():
    assert eagle3_online.trend(2.0, 2.0 + 2 * eagle3_online.TREND_TOLERANCE) == "rose"
    assert eagle3_online.trend(2.0, 2.0 - 2 * eagle3_online.TREND_TOLERANCE) == "fell"
    assert eagle3_online.trend(2.0, 2.0 + eagle3_online.TREND_TOLERANCE / 2) == "held"
    assert eagle3_online.trend(None, 2.0) == "not measured"


@pytest.mark.parametrize("online, frozen, held", [
    ((2.0, 2.3), (2.0, 1.7), True),  # online rose, frozen fell
    ((2.0, 2.0), (2.0, 1.7), True),  # online held, frozen fell
    ((2.0, 1.7), (2.0, 1.5), False),  # both fell
    ((2.0, 2.3), (2.0, 2.0), False),  # the frozen draft did not fall: nothing shown
])
def test_verdict_says_whether_the_claim_held(online, frozen, held):
    ok, sentence = eagle3_online.verdict(run(*online), run(*frozen))
    assert ok is held
    assert ("HELD" in sentence) is held and ("did NOT hold" in sentence) is (not held)


def test_the_two_runs_differ_only_in_online_draft_training(tmp_path):
    from slime_spec.doctor.diagnose import diagnose
    from slime_spec.tools.tiny_model import LLAMA31_ROPE_SCALING, make_tiny_model
    size = eagle3_online.SIZES["full"]
    model = make_tiny_model(tmp_path / "model", arch="llama", hidden_size=32, num_layers=size["layers"],
                            intermediate_size=64, max_position_embeddings=256, rope_scaling=LLAMA31_ROPE_SCALING)
    draft = make_tiny_eagle3_draft(tmp_path / "draft", model)
    train, evals = split_problems(8, 2, 0, size["digits"])
    data, eval_data = write_jsonl(train, tmp_path / "train.jsonl"), write_jsonl(evals, tmp_path / "eval.jsonl")
    online, frozen = (eagle3_online.eagle3_argv(model, draft, data, eval_data, tmp_path / "run", size, 0, online=o)
                      for o in (True, False))
    assert online[:len(frozen)] == frozen
    assert online[len(frozen):] == ["--enable-draft-training", "--draft-lr", eagle3_online.DRAFT_LR,
                                    "--draft-ttt-steps", eagle3_online.TTT_STEPS]
    for argv in (online, frozen):
        parsed = parse(argv)
        assert parsed.unknown_flags == []
        _, findings = diagnose(parsed, launching=False)
        assert [f for f in findings if f.level == "error"] == []
        assert "--spec-auto" not in argv  # a fixed chain: accept length is what the draft earns
        assert argv[argv.index("--sglang-speculative-algorithm") + 1] == "EAGLE3"
        assert argv[argv.index("--sglang-speculative-draft-model-path") + 1] == str(draft)


def test_policy_lr_overrides_the_demos(tmp_path):
    size = eagle3_online.SIZES["smoke"]
    argv = eagle3_online.eagle3_argv(tmp_path / "m", tmp_path / "d", tmp_path / "t", tmp_path / "e", tmp_path / "r",
                                     size, 0, online=True, policy_lr="3e-3")
    parsed = parse(argv)
    assert parsed.namespace.lr == 3e-3 and argv.count("--lr") == 1


def test_draft_lr_reaches_the_online_run_only(tmp_path):
    size = eagle3_online.SIZES["smoke"]
    paths = [tmp_path / n for n in "mdter"]
    online = parse(eagle3_online.eagle3_argv(*paths, size, 0, online=True, draft_lr="3e-3")).namespace
    frozen = parse(eagle3_online.eagle3_argv(*paths, size, 0, online=False, draft_lr="3e-3")).namespace
    assert online.draft_lr == 3e-3 and online.enable_draft_training
    assert not frozen.enable_draft_training
