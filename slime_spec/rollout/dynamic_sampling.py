"""Dynamic sampling (DAPO), as slime's `generate_rollout_async` does it: over-sample prompts, drop the groups a filter
rejects, stop once `--rollout-batch-size` groups are kept, abort the rest.

`--over-sampling-batch-size B` prompts are submitted at a time (default: `--rollout-batch-size`); each finished
group (its `--n-samples-per-prompt` samples, rewarded) goes through `--dynamic-sampling-filter-path`; another B are
submitted whenever the groups kept or still running fall below the target. The filter is called as slime calls it,
`filter(args, samples)`, and returns a `DynamicFilterOutput` or a bool (slime's older filters); slime's own filter
paths (`slime.rollout.filter_hub.dynamic_sampling_filters.*`) resolve to the same filters here, so a slime script
runs unchanged. Dropped groups are counted by the filter's reason, as slime's `rollout/dynamic_filter/drop_{reason}`.

Unlike slime, which samples until the batch fills, a rollout that has taken every prompt of the dataset once without
filling its batch stops with an error naming the filter: a filter that rejects everything would loop forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from typing import Awaitable, Callable, Sequence

from slime_spec.rollout.sample import Sample

SLIME_FILTERS = "slime.rollout.filter_hub.dynamic_sampling_filters."
DROP_PREFIX = "dynamic_filter/drop_"  # + reason: slime's rollout/dynamic_filter/drop_{reason} (metrics.py)


@dataclasses.dataclass
class DynamicFilterOutput:
    """A filter's verdict on one group: `keep`, why not (`reason`, counted in the metrics), and whether to keep it
    anyway when dropping it would leave fewer groups kept or running than the batch needs (no extra round)."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def check_reward_nonzero_std(args, samples: Sequence[Sample], **kwargs) -> DynamicFilterOutput:
    """Keep a group whose rewards differ (GRPO's advantages are all zero otherwise), as slime's filter of that
    name: standard deviation in float64 above 1e-6."""
    import torch

    values = [s.get_reward_value(args) for s in samples]
    rewards = [0.0 if v is None else float(v) for v in values]
    keep = bool(torch.tensor(rewards, dtype=torch.float64).std() > 1e-6)
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args, samples: Sequence[Sample], **kwargs) -> DynamicFilterOutput:
    """`check_reward_nonzero_std`, but a rejected group is kept where another round would be needed."""
    return dataclasses.replace(check_reward_nonzero_std(args, samples), keep_when_insufficient=True)


BUILT_IN = {f.__name__: f for f in (check_reward_nonzero_std, check_reward_nonzero_std_with_fallback)}


def load_filter(path: str | None) -> Callable | None:
    """The filter `--dynamic-sampling-filter-path` names: slime's built-in paths resolve to ours, any other
    `module.function` is imported (an error names the flag)."""
    if path is None:
        return None
    if path.startswith(SLIME_FILTERS) and path.removeprefix(SLIME_FILTERS) in BUILT_IN:
        return BUILT_IN[path.removeprefix(SLIME_FILTERS)]
    from slime_spec.rollout.rewards import load_function

    return load_function(path, "--dynamic-sampling-filter-path")


def call_filter(fn: Callable | None, args, group: list[Sample]) -> DynamicFilterOutput:
    if fn is None:
        return DynamicFilterOutput(keep=True)
    out = fn(args, group)
    return out if isinstance(out, DynamicFilterOutput) else DynamicFilterOutput(keep=bool(out))


def drops(out: DynamicFilterOutput, running_or_kept: int, target: int) -> bool:
    """Whether a rejected group is dropped: always, unless it asks to be kept when no more can be spared."""
    if out.keep:
        return False
    return not (out.keep_when_insufficient and running_or_kept <= target)


@dataclasses.dataclass
class OverSampled:
    """A dynamic rollout's result: the kept groups' samples, renumbered 0.. in submission order; how many prompts of
    the stream it took (kept, dropped and aborted alike); the drop counts by reason; the groups cut off once the
    batch was full (still running, or finished after it filled)."""

    samples: list[Sample]
    prompts_taken: int
    drop_reasons: Counter
    aborted_groups: int

    def metrics(self) -> dict:
        out = {f"{DROP_PREFIX}{reason}": n for reason, n in self.drop_reasons.items()}
        out.update(dynamic_sampling_prompts=self.prompts_taken,
                   dynamic_sampling_dropped=sum(self.drop_reasons.values()),
                   dynamic_sampling_aborted=self.aborted_groups)
        return out


async def over_sample(take: Callable[[int, int], list[list[Sample]]], run_group: Callable[[list[Sample]], Awaitable],
                      *, target: int, over: int, filter_fn: Callable | None, filter_args, max_prompts: int,
                      on_kept: Callable[[list[Sample]], None] = lambda g: None) -> OverSampled:
    """Submit `take(start, over)` groups (prompts start.. of this rollout's stream, each group's `group_index` its
    prompt's place in that stream) whenever fewer than `target` are kept or running, filter each as it finishes, and
    return once `target` are kept; the groups still running are cancelled. Past `max_prompts` prompts without a
    full batch: RuntimeError."""
    pending: dict[asyncio.Task, int] = {}  # task -> the group's position in the stream of this rollout
    kept: list[tuple[int, list[Sample]]] = []
    reasons: Counter = Counter()
    taken = running_or_kept = 0
    try:
        while len(kept) < target:
            while running_or_kept < target:
                if taken >= max_prompts:
                    raise RuntimeError(
                        f"dynamic sampling kept {len(kept)} of {target} groups after taking {taken} prompts (every "
                        f"prompt of --prompt-data at least once): --dynamic-sampling-filter-path dropped the rest "
                        f"({dict(reasons)}); check the filter against the rewards, or drop the flag")
                for g in take(taken, over):
                    pending[asyncio.ensure_future(run_group(g))] = g[0].group_index
                taken += over
                running_or_kept += over
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):  # groups finished together: in stream order
                if len(kept) == target:  # finished, but not needed: cut off with the rest
                    break
                position = pending.pop(task)
                group = task.result()
                out = call_filter(filter_fn, filter_args, group)
                if drops(out, running_or_kept, target):
                    if out.reason:
                        reasons[out.reason] += 1
                    running_or_kept -= 1
                    continue
                kept.append((position, group))
                on_kept(group)
    finally:
        aborted = len(pending)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return OverSampled(renumber([g for _, g in sorted(kept, key=lambda x: x[0])]), taken, reasons, aborted)


def renumber(groups: list[list[Sample]]) -> list[Sample]:
    """The kept groups as one rollout: group g's samples get group_index g and indices g x n .. g x n + n - 1."""
    out = []
    for g, group in enumerate(groups):
        for s in group:
            s.group_index, s.index = g, len(out)
            out.append(s)
    return out
