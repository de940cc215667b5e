"""Running the reward of each sample: off the event loop, bounded in time, failures recorded, never fatal.

The reward functions themselves (`--rm-type` rules, `--custom-rm-path`) are in rewards.py. Here:
- a synchronous function runs in a thread of the runner's own pool, so a slow reward does not stop the rollout
  manager's event loop (requests, progress, other rewards go on); an `async def` one runs on the loop;
- each call is bounded by `--rm-timeout` seconds;
- a reward that raises, times out or returns a value that is not a finite number becomes a recorded reward
  failure of that sample: `sample.reward` stays None and `sample.metadata[REWARD_FAILURE_KEY]` says what
  happened; the trainer leaves the sample out (trainer/finite_guard.py) and the rollout's metrics count it;
- while rewards run longer than `report_every_s`, a line says how many and for how long.
A thread that never returns cannot be stopped from Python: its sample times out and the thread stays busy.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TextIO

from slime_spec.config.run_config import RolloutConfig
from slime_spec.rollout.sample import Sample, Status

REWARD_FAILURE_KEY = "reward_failure"  # Sample.metadata: {"kind": timeout|error|nonfinite, "message": ...}
FAILURE_KINDS = ("error", "timeout", "nonfinite")
REWARD_THREADS = 32  # the pool's size: how many synchronous rewards may run (or hang) at once
REPORT_EVERY_S = 60.0


def reward_call(cfg: RolloutConfig) -> tuple[Callable[[Sample], Any], bool] | None:
    """(function of a sample, whether it is async) for --custom-rm-path or --rm-type; None without a reward."""
    from slime_spec.rollout.rewards import RM_TYPES, RULES, load_function
    if cfg.custom_rm_path:
        user_fn = load_function(cfg.custom_rm_path, "--custom-rm-path")
        takes_args = len(inspect.signature(user_fn).parameters) >= 2  # slime's (args, sample), or (sample)

        def custom(sample: Sample):
            return user_fn(cfg, sample) if takes_args else user_fn(sample)
        return custom, inspect.iscoroutinefunction(user_fn)
    if cfg.rm_type is None:
        return None
    if cfg.rm_type not in RM_TYPES:
        raise ValueError(f"--rm-type={cfg.rm_type!r}: choose one of {RM_TYPES} or pass --custom-rm-path")
    rule = RULES[cfg.rm_type]
    return (lambda sample: rule(sample.response, sample.label)), False


def record_failure(sample: Sample, kind: str, message: str) -> None:
    sample.reward = None
    sample.metadata[REWARD_FAILURE_KEY] = {"kind": kind, "message": f"reward of sample {sample.index}: {message}"}


def failure_of(sample: Sample) -> dict | None:
    return sample.metadata.get(REWARD_FAILURE_KEY)


def reward_failure_metrics(samples: list[Sample]) -> dict:
    """`reward_failures` (samples left out for their reward) and its split by kind."""
    failures = [f for f in (failure_of(s) for s in samples) if f]
    out = {"reward_failures": len(failures)}
    out.update({f"reward_failures_{k}": sum(f["kind"] == k for f in failures) for k in FAILURE_KINDS})
    return out


def report_failures(samples: list[Sample], desc: str, stream: TextIO = sys.stdout) -> None:
    """One console line when some samples of `desc` have no usable reward, with the first one's reason."""
    failures = [f for f in (failure_of(s) for s in samples) if f]
    if failures:
        print(f"[rollout] {desc}: {len(failures)} of {len(samples)} sample(s) have no usable reward and are left "
              f"out of training; first: {failures[0]['message']}", file=stream, flush=True)


class RewardRunner:
    """Assigns `sample.reward` for each finished sample (see the module docstring)."""

    def __init__(self, cfg: RolloutConfig, *, report_every_s: float = REPORT_EVERY_S, stream: TextIO | None = None):
        if cfg.rm_timeout is not None and cfg.rm_timeout <= 0:
            raise ValueError(f"--rm-timeout {cfg.rm_timeout}: give a positive number of seconds")
        self.call = reward_call(cfg)
        self.timeout_s = cfg.rm_timeout
        self.report_every_s = report_every_s
        self.stream = stream
        self._pool: ThreadPoolExecutor | None = None
        self._running: dict[int, tuple[int, float]] = {}  # id -> (sample index, start time)
        self._reporter: asyncio.Task | None = None

    async def assign(self, sample: Sample) -> None:
        if sample.reward is not None:  # set by a custom generate function: still checked
            if not _finite(sample.reward):
                record_failure(sample, "nonfinite", f"the generate function set reward {sample.reward!r}")
            return
        if self.call is None or failure_of(sample):
            return
        if sample.status == Status.ABORTED:
            sample.reward = 0.0
            return
        fn, is_async = self.call
        key = id(sample)
        self._running[key] = (sample.index, time.monotonic())
        self._ensure_reporter()
        try:
            if is_async:
                value = await asyncio.wait_for(fn(sample), self.timeout_s)
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(REWARD_THREADS, thread_name_prefix="reward")
                future = asyncio.get_running_loop().run_in_executor(self._pool, fn, sample)
                value = await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            record_failure(sample, "timeout", f"no result after {self.timeout_s:g} s (--rm-timeout)")
            return
        except Exception as e:  # a reward's own failure: recorded for this sample, the rollout goes on
            record_failure(sample, "error", f"{type(e).__name__}: {e}")
            return
        finally:
            self._running.pop(key, None)
        if not _finite(value):
            record_failure(sample, "nonfinite", f"returned {value!r}, not a finite number")
            return
        sample.reward = float(value)

    def _ensure_reporter(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._report())

    async def _report(self) -> None:
        """While rewards run, a line every `report_every_s` about those running longer than that."""
        while self._running:
            await asyncio.sleep(self.report_every_s)
            now = time.monotonic()
            slow = sorted(((now - t0, i) for i, t0 in self._running.values() if now - t0 >= self.report_every_s),
                          reverse=True)
            if slow:
                print(f"[reward] {len(slow)} reward(s) running for over {self.report_every_s:g} s; the longest, "
                      f"sample {slow[0][1]}, for {slow[0][0]:.0f} s (--rm-timeout {self.timeout_s})",
                      file=self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _finite(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
