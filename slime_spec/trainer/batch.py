"""Rollout samples -> right-padded token tensors with per-token masks, and how a step's samples are split.

Per-token tensors are aligned to target positions (entry j is about token j), like `losses`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime_spec.rollout.sample import Sample, Status

PAD_ID = 0  # padding sits after every real token, so the causal mask alone hides it


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [b, s] long
    loss_mask: torch.Tensor  # [b, s] float: 1.0 on the trained response tokens
    rollout_log_probs: torch.Tensor  # [b, s] float: the engine's log-probs where it reported them, else 0
    has_rollout_log_probs: torch.Tensor  # [b] bool


def response_mask(sample: Sample) -> list[int]:
    """1 for each response token the loss trains (Sample.loss_mask, or all of them); none for aborted samples."""
    if sample.status == Status.ABORTED:
        return [0] * sample.response_length
    if sample.loss_mask is None:
        return [1] * sample.response_length
    if len(sample.loss_mask) != sample.response_length:
        raise ValueError(f"sample {sample.index}: loss_mask has {len(sample.loss_mask)} entries for "
                         f"response_length={sample.response_length}")
    return list(sample.loss_mask)


def collate(samples: list[Sample], device: torch.device | str = "cpu") -> TokenBatch:
    if not samples:
        raise ValueError("collate: no samples")
    seq = max(len(s.tokens) for s in samples)
    ids = torch.full((len(samples), seq), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(samples), seq)
    rollout_lp = torch.zeros(len(samples), seq)
    has_lp = torch.zeros(len(samples), dtype=torch.bool)
    for b, s in enumerate(samples):
        if s.response_length < 0 or s.prompt_length < 1:
            raise ValueError(f"sample {s.index}: response_length={s.response_length} with {len(s.tokens)} tokens; "
                             f"a sample needs at least one prompt token before its response")
        ids[b, :len(s.tokens)] = torch.tensor(s.tokens, dtype=torch.long)
        start = s.prompt_length
        mask[b, start:len(s.tokens)] = torch.tensor(response_mask(s), dtype=torch.float32)
        if s.rollout_log_probs:
            if len(s.rollout_log_probs) != s.response_length:
                raise ValueError(f"sample {s.index}: {len(s.rollout_log_probs)} rollout_log_probs for "
                                 f"response_length={s.response_length}")
            rollout_lp[b, start:len(s.tokens)] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
            has_lp[b] = True
    return TokenBatch(ids.to(device), mask.to(device), rollout_lp.to(device), has_lp.to(device))


def step_slices(n_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                dp_size: int) -> list[list[list[int]]]:
    """Sample indices per optimizer step, per micro-batch, for one data-parallel rank.

    Each optimizer step takes `global_batch_size` consecutive samples; a DP rank takes an equal,
    contiguous share of them and runs it `micro_batch_size` samples at a time.
    """
    if n_samples % global_batch_size:
        raise ValueError(f"--global-batch-size {global_batch_size} must divide the {n_samples} samples of a "
                         f"rollout (rollout_batch_size x n_samples_per_prompt)")
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(f"--global-batch-size {global_batch_size} must be a multiple of --micro-batch-size "
                         f"{micro_batch_size} x data-parallel size {dp_size}")
    per_rank = global_batch_size // dp_size
    steps = []
    for start in range(0, n_samples, global_batch_size):
        mine = list(range(start + dp_rank * per_rank, start + (dp_rank + 1) * per_rank))
        steps.append([mine[i:i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)])
    return steps
