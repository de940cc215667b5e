"""What keeps a non-finite value out of the weights, the engines and the checkpoints.

As Megatron's loop does, a step whose loss or gradient norm is not finite is skipped (no optimizer update)
and counted; here the run stops after `--max-consecutive-skipped-steps` skipped steps in a row, naming what
was not finite and where. A sample whose reward is not finite, or whose reward function failed or timed out
(recorded by rollout/reward_runner.py), is left out: its group's GRPO advantage
is computed without it and it trains no token. Weights are checked before every sync and every save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from slime_spec.rollout.reward_runner import failure_of
from slime_spec.rollout.sample import Sample
from slime_spec.trainer import losses


class NonFiniteError(RuntimeError):
    """The run stops: non-finite values where training cannot go on (named in the message)."""


def reward_left_out(sample: Sample) -> str | None:
    """Why `sample` is left out of training for its reward, or None when its reward is usable."""
    failure = failure_of(sample)
    if failure:
        return failure["message"]
    if sample.reward is None:
        raise ValueError(f"sample {sample.index} has no reward: the rollout must score every sample before training")
    if not math.isfinite(float(sample.reward)):
        return f"reward {sample.reward}"
    return None


def grpo_advantages_without(rewards: Sequence[float | None], group_index: Sequence[int], n_samples_per_prompt: int,
                            left_out: Sequence[bool], rewards_normalization: bool = True,
                            std_normalization: bool = True) -> torch.Tensor:
    """GRPO advantages (losses.grpo_advantages) where each group's mean and std are over its samples that are
    not `left_out`; a left-out sample's advantage is 0 (it trains no token anyway). As slime's reward
    post-processing: without `rewards_normalization` (--disable-rewards-normalization) each advantage is its raw
    reward; without `std_normalization` (--disable-grpo-std-normalization) it is centred on the group's mean only."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_index):
        members.setdefault(g, []).append(i)
    adv = torch.zeros(len(group_index), dtype=torch.float32)
    for g, idx in members.items():
        if len(idx) != n_samples_per_prompt:
            raise ValueError(f"GRPO: prompt group {g} has {len(idx)} samples but --n-samples-per-prompt is "
                             f"{n_samples_per_prompt}; pass every sample of each prompt to the trainer")
        kept = [i for i in idx if not left_out[i]]
        if kept and not rewards_normalization:
            adv[kept] = torch.tensor([float(rewards[i]) for i in kept])
        elif kept:
            adv[kept] = losses.grpo_advantages([float(rewards[i]) for i in kept], [g] * len(kept), len(kept),
                                               std_normalize=std_normalization)
    return adv


def nonfinite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity."""
    return [name for name, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def describe_value(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def step_skip_reason(where: str, step_left_out: Sequence[bool], first_sample: Sample, loss_finite: bool,
                     nonfinite_loss_samples: Sequence, grad_norm: float) -> str | None:
    """Why the optimizer step `where` must be skipped, or None: every sample of it left out for its reward, its loss
    not finite on some rank (`loss_finite` already agreed over ranks), or its gradient norm not finite."""
    if step_left_out and all(step_left_out):
        return f"every sample of {where} was left out for its reward (first: {reward_left_out(first_sample)})"
    if not loss_finite:
        shown = f" (this rank's samples with a non-finite loss: {list(nonfinite_loss_samples)})" \
            if nonfinite_loss_samples else ""
        return f"loss not finite at {where}{shown}"
    if not math.isfinite(grad_norm):
        return f"gradient norm {describe_value(grad_norm)} at {where}"
    return None


@dataclass
class SkipTracker:
    """Skipped optimizer steps: counted, and the run stopped after `max_consecutive` in a row (0: never)."""

    max_consecutive: int
    consecutive: int = 0
    total: int = 0
    reasons: list[str] = field(default_factory=list)  # of the current run of skips

    def applied(self) -> None:
        self.consecutive = 0
        self.reasons.clear()

    def skipped(self, reason: str) -> None:
        self.consecutive += 1
        self.total += 1
        self.reasons.append(reason)
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{self.consecutive} optimizer steps in a row were skipped for non-finite values "
                f"(--max-consecutive-skipped-steps {self.max_consecutive}), so the run stops; no update was made "
                f"from them. " + "; ".join(self.reasons))


def check_weights_finite(named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]], purpose: str) -> None:
    """Raise NonFiniteError naming every non-finite tensor `named_tensors()` yields before the weights are `purpose`
    (synced, saved). Collective: every rank checks its own and all learn what any rank found. A rank that fails to
    read its weights still joins the collective (else the others would wait on it), and every rank names it."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        report = (rank, nonfinite_tensors(named_tensors()), None)
    except Exception as e:
        own_error, report = e, (rank, [], f"{type(e).__name__}: {e}")
    else:
        own_error = None
    reports = [report]
    if dist.is_initialized() and dist.get_world_size() > 1:
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
    if own_error is not None:
        raise own_error
    failed = [(r, error) for r, _, error in reports if error]
    if failed:
        raise RuntimeError("; ".join(f"trainer rank {r} failed reading its weights before they are {purpose}: "
                                     f"{error}" for r, error in failed))
    total = sum(len(bad) for _, bad, _ in reports)
    if total:
        found = "; ".join(f"rank {r}: {bad}" for r, bad, _ in reports if bad)
        raise NonFiniteError(f"{total} weight tensor(s) hold NaN or inf, so they are not {purpose}; {found}")
