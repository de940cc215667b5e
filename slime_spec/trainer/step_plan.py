"""Which samples each data-parallel rank trains in which micro-batch of which optimizer step, how long the model rows
are, and what a train step has prepared before its first update. Pure functions of the samples' lengths and the
trainer's layout (`StepLayout`), so every rank can compute every other rank's plan."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slime_spec.rollout.sample import Sample, Status
from slime_spec.trainer.batch import TokenBatch, packed_step_slices, step_slices

Steps = list[list[list[int]]]  # sample indices per optimizer step, per micro-batch


@dataclass(frozen=True)
class StepLayout:
    global_batch_size: int
    micro_batch_size: int
    max_tokens_per_gpu: int | None  # set: packed micro-batches of at most this many tokens
    dp_rank: int
    dp_size: int
    ep_size: int = 1
    row_multiple: int = 1  # sequence parallelism: every row's length a multiple of the TP size

    @property
    def packed(self) -> bool:
        return bool(self.max_tokens_per_gpu)


def plan(lengths: list[int], layout: StepLayout, dp_rank: int | None = None) -> Steps:
    """This rank's (or data-parallel rank `dp_rank`'s) sample indices per optimizer step, per micro-batch. Under
    expert parallelism every rank packs as many micro-batches per step as the others (collective MoE)."""
    dp_rank = layout.dp_rank if dp_rank is None else dp_rank
    if layout.packed:
        return packed_step_slices(lengths, layout.global_batch_size, layout.max_tokens_per_gpu, dp_rank,
                                  layout.dp_size, equal_counts=layout.ep_size > 1)
    return step_slices(len(lengths), layout.global_batch_size, layout.micro_batch_size, dp_rank, layout.dp_size)


def row_lengths(lengths: list[int], steps: Steps, layout: StepLayout) -> tuple[int, list[list[int]]]:
    """The least model-row lengths: (padded rows' length, each packed micro-batch's row length); 0 where any do.

    Under expert parallelism every EP rank must hand the MoE layers' all-gather token dispatcher the same token
    count: padded rows as long as the rollout's longest sample; a packed row as long as the longest packed row of
    that micro-batch on any data-parallel rank (each rank computes every rank's plan). Under sequence parallelism a
    row's length is a multiple of the TP size. Padding follows the real tokens, unseen by them (causal mask, its own
    packed segment), and dropless routing computes each token alone."""
    multiple = layout.row_multiple
    seq_len = max(lengths) if layout.ep_size > 1 and not layout.packed else 0
    rows = [[sum(lengths[i] for i in mb) for mb in step] for step in steps] if layout.packed else \
        [[0] * len(step) for step in steps]
    if layout.packed and layout.ep_size > 1:
        plans = [plan(lengths, layout, r) for r in range(layout.dp_size)]
        rows = [[max(sum(lengths[i] for i in p[s_idx][m_idx]) for p in plans) for m_idx in range(len(step))]
                for s_idx, step in enumerate(steps)]
    if multiple > 1 and not layout.packed:
        seq_len = -(-max(seq_len, *lengths) // multiple) * multiple
    return seq_len, [[-(-r // multiple) * multiple for r in step] for step in rows]


def step_tokens(lengths: list[int], trained: list[int], steps: Steps, layout: StepLayout) -> list[int]:
    """--calculate-per-token-loss: the trained tokens of each optimizer step over every data-parallel rank (each rank
    plans every rank's share), what slime's token-level loss divides by."""
    plans = [steps] if layout.dp_size == 1 else [plan(lengths, layout, r) for r in range(layout.dp_size)]
    return [max(1, sum(trained[i] for p in plans for mb in p[s_idx] for i in mb)) for s_idx in range(len(steps))]


def check_rollout_log_probs(samples: list[Sample], flag: str) -> None:
    """--use-tis and --use-rollout-logprobs read each trained token's rollout log-prob: every sample that trains must
    carry them."""
    missing = [s.index for s in samples
               if s.status != Status.ABORTED and s.response_length > 0 and not s.rollout_log_probs]
    if missing:
        raise ValueError(f"{flag} reads each token's rollout log-prob, and {len(missing)} sample(s) came back without "
                         f"them (first: sample {missing[0]}): a custom generate function must keep the engine's "
                         f"output log-probs (Sample.rollout_log_probs), or drop {flag}")


@dataclass
class PreparedStep:
    """One train_step's inputs, computed before the first update."""

    sft: bool
    steps: Steps
    batches: list[list[TokenBatch]]
    advantages: torch.Tensor | None
    old: list[list[torch.Tensor]] | None
    ref: list[list[torch.Tensor]] | None
    sums: torch.Tensor
    left_out: list[bool] = field(default_factory=list)  # per sample: left out for its reward (reward_left_out)
    step_tokens: list[int] | None = None  # --calculate-per-token-loss: trained tokens per optimizer step
    nonfinite_loss_samples: dict[int, list[int]] = field(default_factory=dict)  # step -> sample positions
