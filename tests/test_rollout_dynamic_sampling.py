"""Dynamic sampling as slime's generate_rollout_async does it (rollout/dynamic_sampling.py): over-sampled groups are
filtered as they finish, more are submitted when too few are kept or running, the batch stops at
--rollout-batch-size groups and the rest are cancelled; slime's filters and their metric names. The generation here
is a test double (rewards by prompt, finish order by delay); through real engines: tests/e2e/test_train_loop.py."""

import asyncio
import json
import types
from pathlib import Path

import pytest

from slime_spec.doctor.diagnose import main as doctor
from slime_spec.rollout import dynamic_sampling as ds
from slime_spec.rollout.rewards import load_function
from slime_spec.rollout.sample import Sample

N = 2  # samples per prompt


def take_from(rewards_of):
    """`take(start, count)` over a stream of prompts whose group p gets rewards `rewards_of(p)`."""
    def take(start, count):
        return [[Sample(index=(start + i) * N + j, group_index=start + i, prompt=f"p{start + i}", reward=r,
                        metadata={"prompt_index": start + i}) for j, r in enumerate(rewards_of(start + i))]
                for i in range(count)]
    return take


def run_with_delays(delay_of, started, cancelled):
    async def run_group(group):
        p = group[0].group_index
        started.append(p)
        try:
            await asyncio.sleep(delay_of(p))
        except asyncio.CancelledError:
            cancelled.append(p)
            raise
        return group
    return run_group


def over_sample(rewards_of, delay_of, *, target=2, over=3, filter_fn=ds.check_reward_nonzero_std, max_prompts=100):
    started, cancelled = [], []
    result = asyncio.run(ds.over_sample(take_from(rewards_of), run_with_delays(delay_of, started, cancelled),
                                        target=target, over=over, filter_fn=filter_fn, filter_args=None,
                                        max_prompts=max_prompts))
    return result, started, cancelled


def test_rejected_groups_are_dropped_refilled_and_the_rest_cancelled():
    # prompts 0, 1, 3, 4 have equal rewards (zero std, dropped); 2 and 5 differ. Prompts finish in order of delay.
    varied = {2, 5}
    result, started, cancelled = over_sample(lambda p: [1.0, 0.0] if p in varied else [1.0, 1.0],
                                             lambda p: 0.01 * (p + 1) if p != 5 else 0.005)
    # first round 0-2: 0, 1 dropped -> 1 running or kept < 2 -> second round 3-5; 5 finishes first, then 2
    assert started == [0, 1, 2, 3, 4, 5]
    assert [s.metadata["prompt_index"] for s in result.samples] == [2, 2, 5, 5]  # kept in stream order
    assert [(s.group_index, s.index) for s in result.samples] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert result.prompts_taken == 6 and result.drop_reasons == {"zero_std_1.0": 2}
    assert result.aborted_groups == 2 and set(cancelled) <= {3, 4}  # cut off (cancelled unless already finished)
    assert result.metrics() == {"dynamic_filter/drop_zero_std_1.0": 2, "dynamic_sampling_prompts": 6,
                                "dynamic_sampling_dropped": 2, "dynamic_sampling_aborted": 2}


def test_without_a_filter_the_first_groups_to_finish_fill_the_batch():
    result, started, cancelled = over_sample(lambda p: [1.0, 1.0], lambda p: 0.01 * (4 - p), filter_fn=None, over=4)
    assert [s.metadata["prompt_index"] for s in result.samples[::N]] == [2, 3]  # 3 and 2 finished first
    assert result.prompts_taken == 4 and result.aborted_groups == 2 and not result.drop_reasons


def test_keep_when_insufficient_keeps_a_rejected_group_instead_of_another_round():
    result, started, _ = over_sample(lambda p: [1.0, 1.0] if p else [1.0, 0.0], lambda p: 0.01 * (p + 1),
                                     filter_fn=ds.check_reward_nonzero_std_with_fallback)
    # 0 kept; 1 rejected while 3 groups are kept or running for a target of 2: dropped; 2 rejected with exactly 2
    # left: kept rather than another round
    assert started == [0, 1, 2] and [s.metadata["prompt_index"] for s in result.samples[::N]] == [0, 2]
    assert result.drop_reasons == {"zero_std_1.0": 1} and result.prompts_taken == 3


def test_a_filter_written_for_slime_reads_rewards_as_slimes_filters_do():
    def slime_style(args, samples, **kwargs):  # as in slime's filter_hub: get_reward_value(args), DynamicFilterOutput
        return ds.DynamicFilterOutput(keep=samples[0].get_reward_value(args) > 0, reason="nonpositive")

    result, _, _ = over_sample(lambda p: [float(p % 3), 0.0], lambda p: 0.002 * (p + 1), filter_fn=slime_style)
    assert [s.metadata["prompt_index"] for s in result.samples[::N]] == [1, 2]
    assert result.drop_reasons == {"nonpositive": 1}


def test_a_filter_that_returns_a_bool_as_slimes_older_ones():
    result, _, _ = over_sample(lambda p: [1.0, 0.0], lambda p: 0.002 * (p + 1),
                               filter_fn=lambda args, g: g[0].group_index % 2)
    assert [s.metadata["prompt_index"] for s in result.samples[::N]] == [1, 3] and not result.drop_reasons


def test_a_filter_that_rejects_everything_stops_after_one_pass_over_the_data():
    with pytest.raises(RuntimeError, match="kept 0 of 2 groups after taking 12 prompts.*--dynamic-sampling-filter"):
        over_sample(lambda p: [0.0, 0.0], lambda p: 0.001, max_prompts=12)


def test_slimes_filter_paths_resolve_to_the_same_filters_and_others_are_imported():
    for name in ("check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"):
        assert ds.load_filter(f"slime.rollout.filter_hub.dynamic_sampling_filters.{name}") is ds.BUILT_IN[name]
    assert ds.load_filter("tests.helpers.rollout_checks.keep_even_prompts") is \
        load_function("tests.helpers.rollout_checks.keep_even_prompts", "x")
    with pytest.raises(Exception, match="--dynamic-sampling-filter-path"):
        ds.load_filter("no_such_module.no_such_filter")
    def group(*rewards):
        return [Sample(index=i, group_index=0, prompt="p", reward=r) for i, r in enumerate(rewards)]

    verdict = ds.check_reward_nonzero_std(None, group(0.25, 0.25))
    assert not verdict.keep and verdict.reason == "zero_std_0.2"  # slime's reason: round(reward, 1)
    assert ds.check_reward_nonzero_std(None, group(0.25, 0.26)).keep


@pytest.mark.parametrize("argv", [["--over-sampling-batch-size", "1", "--rollout-batch-size", "2"],
                                  ["--over-sampling-batch-size", "8", "--rollout-history-drafting",
                                   "--sglang-speculative-algorithm", "NGRAM",
                                   "--sglang-speculative-ngram-external-sam-budget", "4"]])
def test_doctor_refuses_a_batch_it_cannot_fill_and_history_drafting_beside_it(capsys, argv):
    checkpoint = Path(__file__).parent / "data" / "slime_checkpoints" / "Qwen3-4B"
    assert doctor(["--hf-checkpoint", str(checkpoint), "--rollout-backend", "sglang", "--json", *argv]) == 2
    errors = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["level"] == "error"]
    assert [f["code"] for f in errors] == ["FLAG_CONFLICT"] and "--over-sampling-batch-size" in errors[0]["message"]


def test_an_engine_that_cannot_take_the_abort_after_a_dynamic_rollout_is_reported(capsys):
    """The cut-off requests were cancelled on our side already; an engine being restarted that refuses SGLang's
    abort_all is printed, and the rollout stands."""
    from slime_spec.rollout.manager import RolloutManager

    class Actor:  # test double for an EngineActor handle: `abort_request.remote()` is awaitable
        def __init__(self, error):
            self.error, self.abort_request = error, self

        def remote(self):
            async def call():
                if self.error:
                    raise self.error
                return {"success": True}
            return call()

    manager = RolloutManager.__new__(RolloutManager)
    manager.fleet = types.SimpleNamespace(actors=[Actor(None), Actor(ConnectionError("restarting"))],
                                          urls=["http://127.0.0.1:1", "http://127.0.0.1:2"])
    asyncio.run(manager._abort_cut_off())
    out = capsys.readouterr().out
    assert "http://127.0.0.1:2: /abort_request after dynamic sampling failed (ConnectionError: restarting)" in out
    assert "127.0.0.1:1" not in out
