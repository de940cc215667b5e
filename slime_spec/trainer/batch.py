"""Rollout samples -> right-padded token tensors with per-token masks, and how a step's samples are split:
`micro_batch_size` samples at a time, or (with --max-tokens-per-gpu) packed by tokens and balanced by
tokens over data-parallel ranks.

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
    lengths: torch.Tensor  # [b] long: tokens of each sample (the rest of its row is padding)
    min_row_len: int = 0  # packed: the model row's least length (equal token counts on every EP rank)


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


def collate(samples: list[Sample], device: torch.device | str = "cpu", min_seq_len: int = 0) -> TokenBatch:
    """`min_seq_len`: pad the rows to at least this many tokens (equal shapes on every rank of a collective)."""
    if not samples:
        raise ValueError("collate: no samples")
    seq = max(min_seq_len, *(len(s.tokens) for s in samples))
    ids = torch.full((len(samples), seq), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(samples), seq)
    rollout_lp = torch.zeros(len(samples), seq)
    has_lp = torch.zeros(len(samples), dtype=torch.bool)
    lengths = torch.tensor([len(s.tokens) for s in samples], dtype=torch.long)
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
    return TokenBatch(ids.to(device), mask.to(device), rollout_lp.to(device), has_lp.to(device), lengths.to(device))


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


def balance_by_tokens(lengths: list[int], indices: list[int], n_parts: int) -> list[list[int]]:
    """`indices` dealt into `n_parts` equal-count parts with near-equal token sums: longest first, each to
    the lightest part that still has room (as slime balances data-parallel ranks)."""
    per_part = len(indices) // n_parts
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    tokens = [0] * n_parts
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        part = min((p for p in range(n_parts) if len(parts[p]) < per_part), key=lambda p: (tokens[p], p))
        parts[part].append(i)
        tokens[part] += lengths[i]
    return [sorted(p) for p in parts]


def pack_by_tokens(lengths: list[int], indices: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: micro-batches of at most `max_tokens` tokens, as few as it finds."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        if lengths[i] > max_tokens:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, more than --max-tokens-per-gpu {max_tokens}: "
                             f"raise --max-tokens-per-gpu to at least the longest prompt + response "
                             f"(--rollout-max-prompt-len + --rollout-max-response-len)")
        b = next((b for b in range(len(bins)) if room[b] >= lengths[i]), None)
        if b is None:
            bins.append([])
            room.append(max_tokens)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
    return [sorted(b) for b in bins]


def split_into(bins: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """`bins` split until there are `count` of them: the bin with the most tokens (of those holding two or more
    samples) is halved, its samples dealt longest first, alternately. Needs count <= the number of samples."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        i = max((i for i, b in enumerate(bins) if len(b) > 1), key=lambda i: (sum(lengths[j] for j in bins[i]), -i))
        ordered = sorted(bins[i], key=lambda j: (-lengths[j], j))
        bins[i:i + 1] = [sorted(ordered[0::2]), sorted(ordered[1::2])]
    return bins


def packed_step_slices(lengths: list[int], global_batch_size: int, max_tokens: int, dp_rank: int,
                       dp_size: int, equal_counts: bool = False) -> list[list[list[int]]]:
    """Like `step_slices`, with micro-batches packed by tokens: each optimizer step's `global_batch_size`
    consecutive samples are balanced by tokens over the data-parallel ranks (equal sample counts), then
    this rank's share is packed into micro-batches of at most `max_tokens` tokens.

    `equal_counts`: every rank gets as many micro-batches in a step as the rank that needs the most (its bins
    split, `split_into`), as a collective layer (expert parallel's token exchange) needs; every rank computes
    every rank's packing from the same lengths, so no communication is needed."""
    n_samples = len(lengths)
    if n_samples % global_batch_size:
        raise ValueError(f"--global-batch-size {global_batch_size} must divide the {n_samples} samples of a "
                         f"rollout (rollout_batch_size x n_samples_per_prompt)")
    if global_batch_size % dp_size:
        raise ValueError(f"--global-batch-size {global_batch_size} must be a multiple of the data-parallel "
                         f"size {dp_size}")
    steps = []
    for start in range(0, n_samples, global_batch_size):
        shares = balance_by_tokens(lengths, list(range(start, start + global_batch_size)), dp_size)
        if not equal_counts:
            steps.append(pack_by_tokens(lengths, shares[dp_rank], max_tokens))
            continue
        packs = [pack_by_tokens(lengths, share, max_tokens) for share in shares]
        steps.append(split_into(packs[dp_rank], max(len(p) for p in packs), lengths))
    return steps
