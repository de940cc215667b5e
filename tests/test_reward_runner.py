"""Rewards that fail or hang (rollout/reward_runner.py): a synchronous reward runs off the event loop, each is
bounded by --rm-timeout, a failure / timeout / non-finite value is recorded for its sample (left out of training,
counted), and lines keep coming while rewards run."""

from __future__ import annotations

import asyncio
import importlib
import sys
import textwrap

import pytest

from slime_spec.config.run_config import RolloutConfig
from slime_spec.rollout.reward_runner import RewardRunner, failure_of, reward_failure_metrics
from slime_spec.rollout.sample import Sample, Status


@pytest.fixture
def rm_module(tmp_path, monkeypatch):
    (tmp_path / "rm_cases.py").write_text(textwrap.dedent("""
        import threading
        LOOP_DID_RUN = threading.Event()
        RELEASE = threading.Event()

        def needs_the_loop(sample):  # returns only if the event loop ran while this blocked
            return 1.0 if LOOP_DID_RUN.wait(timeout=30) else -1.0

        def hangs(sample):
            RELEASE.wait(timeout=30)
            return 1.0

        def by_response(sample):
            if sample.response == "raise":
                raise ValueError("grader crashed")
            return {"nan": float("nan"), "inf": float("inf"), "text": "abc"}.get(sample.response, 0.5)

        async def slime_style(args, sample):
            return 2.0 if args.rm_timeout else 0.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("rm_cases")
    yield module
    module.RELEASE.set()  # a reward thread still blocked returns
    sys.modules.pop("rm_cases", None)


def runner(fn: str, timeout: float = 60.0, **kw) -> RewardRunner:
    return RewardRunner(RolloutConfig(hf_checkpoint="x", custom_rm_path=f"rm_cases.{fn}", rm_timeout=timeout), **kw)


def sample(i=0, response="") -> Sample:
    return Sample(index=i, group_index=0, prompt="p", response=response)


def test_a_synchronous_reward_runs_off_the_event_loop(rm_module):
    async def main():
        s = sample()
        task = asyncio.create_task(runner("needs_the_loop").assign(s))
        await asyncio.sleep(0)  # the reward has started on its thread; the loop goes on
        rm_module.LOOP_DID_RUN.set()
        await task
        return s

    assert asyncio.run(main()).reward == 1.0


def test_a_hanging_reward_times_out_as_a_recorded_failure(rm_module):
    s = sample(3)
    asyncio.run(runner("hangs", timeout=0.2).assign(s))
    assert s.reward is None
    assert failure_of(s) == {"kind": "timeout", "message": "reward of sample 3: no result after 0.2 s (--rm-timeout)"}


def test_failures_and_nonfinite_values_are_recorded_and_counted(rm_module):
    samples = [sample(i, r) for i, r in enumerate(["ok", "raise", "nan", "inf", "text"])]
    r = runner("by_response")

    async def main():
        await asyncio.gather(*(r.assign(s) for s in samples))

    asyncio.run(main())
    assert samples[0].reward == 0.5 and failure_of(samples[0]) is None
    assert failure_of(samples[1]) == {"kind": "error", "message": "reward of sample 1: ValueError: grader crashed"}
    assert failure_of(samples[2])["message"] == "reward of sample 2: returned nan, not a finite number"
    assert [failure_of(s)["kind"] for s in samples[2:]] == ["nonfinite"] * 3
    assert all(s.reward is None for s in samples[1:])
    assert reward_failure_metrics(samples) == {"reward_failures": 4, "reward_failures_error": 1,
                                               "reward_failures_timeout": 0, "reward_failures_nonfinite": 3}


def test_async_slime_signature_aborted_samples_and_rewards_set_by_generate(rm_module):
    r = runner("slime_style")
    ok, aborted, preset = sample(0), sample(1), sample(2)
    aborted.status = Status.ABORTED
    preset.reward = float("-inf")  # a custom generate function set it
    for s in (ok, aborted, preset):
        asyncio.run(r.assign(s))
    assert ok.reward == 2.0 and aborted.reward == 0.0
    assert failure_of(preset)["kind"] == "nonfinite" and preset.reward is None


def test_progress_lines_keep_coming_while_a_reward_runs(rm_module):
    class Console:
        """Stands in for the console: lets the hanging reward return once a progress line was written."""

        def __init__(self):
            self.lines = []

        def write(self, text):
            self.lines.append(text)
            if "running for over" in text:
                rm_module.RELEASE.set()

        def flush(self):
            pass

    console = Console()
    s = sample(7)
    asyncio.run(runner("hangs", report_every_s=0.01, stream=console).assign(s))
    assert s.reward == 1.0
    assert any("1 reward(s) running for over 0.01 s; the longest, sample 7" in line for line in console.lines)


def test_nonpositive_timeout_is_refused():
    with pytest.raises(ValueError, match="--rm-timeout 0"):
        RewardRunner(RolloutConfig(hf_checkpoint="x", rm_type="math", rm_timeout=0))
