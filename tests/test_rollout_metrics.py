import json

import pytest

from slime_spec.rollout.generate import apply_generate_output
from slime_spec.rollout.metrics import (
    REQUIRED_KEYS,
    format_metrics_line,
    format_speedup,
    rollout_metrics,
    slime_log_keys,
    spec_summary,
    time_shares,
    wandb_logged_in,
    wandb_mode,
    write_metrics_line,
)
from slime_spec.rollout.sample import Sample, SpecStats, Status


def _s(i, completion, verify, engine=0, accepted=None, drafted=None, reward=None, status=Status.COMPLETED):
    return Sample(index=i, group_index=i, prompt="p", tokens=[0] * (3 + completion), response_length=completion,
                  reward=reward, status=status, engine_index=engine,
                  spec=SpecStats(completion, verify, accepted, drafted))


def test_accept_length_weighted_vs_sample_mean():
    # one long sample accepting well, one short sample accepting badly
    samples = [_s(0, 100, 25), _s(1, 4, 4, engine=1)]
    m = spec_summary(samples)
    assert m["spec_accept_length_token_weighted"] == pytest.approx(104 / 29)
    assert m["spec_accept_length"] == pytest.approx((4.0 + 1.0) / 2)  # slime's meaning: the per-sample mean
    assert m["spec_accept_rate"] is None


def test_acceptance_rate_only_from_reporting_samples():
    m = spec_summary([_s(0, 10, 4, accepted=6, drafted=12), _s(1, 5, 5)])
    assert m["spec_accept_rate"] == pytest.approx(0.5) and m["spec_draft_tokens"] == 12


def test_no_speculation_is_one():
    m = spec_summary([_s(0, 10, 0)])
    assert m["spec_accept_length_token_weighted"] == 1.0 and m["spec_accept_length"] == 1.0


def test_rollout_metrics_keys_and_per_engine():
    samples = [_s(0, 8, 2, engine=0, reward=1.0), _s(1, 6, 3, engine=1, reward=0.0, status=Status.TRUNCATED),
               _s(2, 0, 0, engine=1, status=Status.ABORTED)]
    m = rollout_metrics(7, samples, 2.0, engine_restarts=1)
    assert set(REQUIRED_KEYS) <= set(m)
    assert m["rollout_id"] == 7 and m["num_samples"] == 3 and m["response_tokens"] == 14
    assert m["tokens_per_s"] == 7.0 and m["truncated_ratio"] == pytest.approx(1 / 3) and m["aborted"] == 1
    assert m["reward_mean"] == 0.5 and m["engine_restarts"] == 1 and m["prompt_tokens"] == 9
    assert m["engine_0/spec_accept_length"] == 4.0 and m["engine_1/spec_accept_length"] == 2.0
    assert m["spec_accept_length_token_weighted"] == pytest.approx(14 / 5)
    assert m["spec_accept_length"] == pytest.approx((4.0 + 2.0) / 2)
    line = format_metrics_line(m)
    # the console line reads at a glance: the per-engine and token-weighted figures are in the JSONL only
    assert line == ("rollout 7 | reward 0.500 | truncated 33% | accept_len 3.00 | 3 samples, 7 tok/s, 2.0s | "
                    "ABORTED 1 | engine restarts 1")


def test_write_metrics_line_appends(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    write_metrics_line(path, {"rollout_id": 0, "a": 1.5})
    write_metrics_line(path, {"rollout_id": 1, "train/loss": 0.1})
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [{"rollout_id": 0, "a": 1.5}, {"rollout_id": 1, "train/loss": 0.1}]


def _output(ids, finish="stop", verify=2, text="xy"):
    return {"text": text, "output_ids": ids,
            "meta_info": {"completion_tokens": len(ids), "spec_verify_ct": verify, "finish_reason": {"type": finish},
                          "output_token_logprobs": [[-0.1 * (k + 1), t, None] for k, t in enumerate(ids)]}}


def test_apply_generate_output_sums_multi_request():
    s = Sample(index=0, group_index=0, prompt="p", tokens=[5, 6])
    apply_generate_output(s, _output([7, 8, 9], verify=1))
    apply_generate_output(s, _output([10], finish="length", verify=1))
    assert s.tokens == [5, 6, 7, 8, 9, 10] and s.response_length == 4 and s.prompt_length == 2
    assert s.rollout_log_probs == pytest.approx([-0.1, -0.2, -0.3, -0.1])
    assert s.spec.completion_tokens == 4 and s.spec.verify_ct == 2 and s.spec.accept_length == 2.0
    assert s.status == Status.TRUNCATED and s.response == "xyxy"
    bad = _output([1, 2])
    bad["output_ids"] = [1, 3]
    with pytest.raises(ValueError, match="disagree"):
        apply_generate_output(Sample(index=0, group_index=0, prompt="p"), bad)


def test_apply_generate_output_abort():
    s = Sample(index=0, group_index=0, prompt="p")
    out = _output([1])
    out["meta_info"]["finish_reason"] = {"type": "abort", "message": "paused"}
    apply_generate_output(s, out)
    assert s.status == Status.ABORTED and s.error == "paused"


def test_slime_log_keys_namespaces_and_steps():
    step = {"rollout_id": 3, "reward_mean": 0.5, "response_len_mean": 7.0, "spec_accept_length": 2.5,
            "spec_accept_length_token_weighted": 2.2, "truncated_ratio": 0.25, "engine_0/spec_accept_length": 2.5,
            "rollout_time_s": 1.5, "tokens_per_s": 100.0, "loss": 0.1, "grad_norm": 0.9, "mtp_loss": 3.0,
            "weight_sync_s": 0.2, "spec_canary_accept_length": 2.4, "eval/aime/reward_mean": 0.3,
            "eval/aime/truncated_ratio": 0.1, "eval/aime/spec_accept_length": 2.6, "spec_accept_rate": None}
    keys = slime_log_keys(step, train_steps_per_rollout=2)
    assert keys == {
        "rollout/step": 3, "train/step": 7, "eval/step": 3,
        "rollout/raw_reward": 0.5, "rollout/response_len/mean": 7.0, "rollout/spec_accept_length": 2.5,
        "rollout/spec_accept_length_token_weighted": 2.2, "rollout/truncated_ratio": 0.25,
        "rollout/engine_0/spec_accept_length": 2.5, "rollout/spec_canary_accept_length": 2.4,
        "perf/rollout_time": 1.5, "perf/rollout_tokens_per_sec": 100.0, "perf/update_weights_time": 0.2,
        "train/loss": 0.1, "train/grad_norm": 0.9, "train/mtp_loss": 3.0,
        "eval/aime": 0.3, "eval/aime-truncated_ratio": 0.1, "eval/aime/spec_accept_length": 2.6}
    rollout_only = slime_log_keys({"rollout_id": 0, "reward_mean": 1.0})
    assert "train/step" not in rollout_only and "eval/step" not in rollout_only


def test_wandb_mode_respects_flag_env_key_and_login(tmp_path):
    assert wandb_mode("disabled", {"WANDB_MODE": "online"}, True, True) == ("disabled", "--wandb-mode")
    assert wandb_mode(None, {"WANDB_MODE": "offline"}, True, True) == ("offline", "WANDB_MODE")
    assert wandb_mode(None, {}, True, False)[0] == "online"
    assert wandb_mode(None, {}, False, True) == ("online", "the key stored by `wandb login`")
    mode, why = wandb_mode(None, {}, False, False)
    assert mode == "offline" and "wandb login" in why and "--wandb-mode online" in why
    netrc = tmp_path / ".netrc"
    env = {"NETRC": str(netrc)}
    assert not wandb_logged_in(env, None)
    netrc.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    netrc.chmod(0o600)
    assert wandb_logged_in(env, None) and not wandb_logged_in(env, "https://wandb.example.com")


def test_speedup_is_a_perf_key_and_a_console_clause():
    step = {"rollout_id": 4, "spec_speedup": 1.5, "spec_speedup_plain_s": 3.0, "spec_speedup_spec_s": 2.0,
            "spec_speedup_accept_length": 2.25}
    keys = slime_log_keys(step)
    assert keys["perf/spec_speedup"] == 1.5 and keys["perf/spec_speedup_plain_s"] == 3.0
    assert format_speedup(step) == "spec_speedup 1.50x (3.00s plain / 2.00s speculative)"
    assert format_speedup({**step, "spec_speedup_passes": 3}) == \
        "spec_speedup 1.50x (3.00s plain / 2.00s speculative, median of 3 passes)"
    assert format_speedup({"rollout_id": 1}) is None
    assert format_speedup({**step, "spec_speedup_frozen": 0.75}).endswith(", draft frozen 0.75x")


def test_time_shares_from_engine_counters_before_and_after_a_rollout():
    times = lambda d, v, s, p: {"draft_s": d, "verify_s": v, "sampling_s": s, "plain_s": p}  # noqa: E731
    before = {0: {"engine_step_s": 10.0, "spec_step_times": times(1.0, 4.0, 1.0, 2.0)},
              1: {"engine_step_s": 50.0},                      # restarted during the rollout: counters went back
              2: {"avg_spec_accept_length": 2.0}}              # no counters (real SGLang): left out
    after = {0: {"engine_step_s": 18.0, "spec_step_times": times(2.0, 8.0, 2.0, 2.8)},
             1: {"engine_step_s": 3.0}, 2: {"avg_spec_accept_length": 2.5}}
    m = time_shares(before, after, rollout_time_s=10.0)
    assert m["time_share_engine"] == pytest.approx(0.8) and m["time_share_outside_engine"] == pytest.approx(0.2)
    assert (m["time_share_draft"], m["time_share_verify"], m["time_share_sampling"], m["time_share_plain"]) == \
        pytest.approx((1 / 8, 4 / 8, 1 / 8, 0.8 / 8))
    assert time_shares({}, after, 10.0) == {} and time_shares(before, after, 0.0) == {}
    assert "time_share" not in format_metrics_line({**rollout_metrics(0, [_s(0, 10, 4)], 1.0), **m})
