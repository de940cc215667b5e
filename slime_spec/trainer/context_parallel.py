"""Context parallelism (--context-parallel-size): each rank of a context-parallel group runs a part of every row.

Megatron's layout: a row of L positions is cut into 2 x CP chunks and CP rank c holds chunks c and 2CP-1-c, so every
rank gets as many early (cheap under a causal mask) as late positions. megatron-core's own CP-aware code reads the
same layout: the MTP layers' `roll_tensor` exchanges the chunk boundaries with the neighbouring ranks, and multi-latent
attention's RoPE table picks this rank's chunks. Everything per token (embedding, norms, MLP and MoE, output layer)
runs on the rank's own positions; attention gathers the keys and values of every rank (`gather_keys_values`: an
all-gather forward, a reduce-scatter backward) and masks this rank's query rows against every column of the row.

The policy's per-token log-probs and entropies, and the MTP layers' hidden states, come back to every CP rank of the
group in row order (`ContextSplit.gather`: the backward keeps each rank's own positions), so the loss code reads
whole rows as at CP 1 and each rank's gradients are those of its own positions; the gradient sum over the
data-parallel x context-parallel group completes them. (Megatron sums each rank's partial loss instead; gathering
[rows, L] log-probs is as cheap and leaves one loss function.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def row_positions(length: int, size: int, rank: int, device=None) -> torch.Tensor:
    """The row positions CP rank `rank` of `size` holds, in its local order: chunks rank and 2 x size - 1 - rank."""
    if length % (2 * size):
        raise ValueError(f"a row of {length} positions does not split into 2 x --context-parallel-size {size} chunks")
    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


@functools.lru_cache(maxsize=64)
def gathered_order(length: int, size: int, device=None) -> torch.Tensor:
    """For each row position, where it sits in the rank-by-rank concatenation of every rank's part. Cached: every
    attention layer of every micro-batch reads it (read-only) for its row length."""
    held = torch.cat([row_positions(length, size, r, device) for r in range(size)])
    return torch.argsort(held)


def _group():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def gather_keys_values(t: torch.Tensor) -> torch.Tensor:
    """[s_local, b, ...] keys or values of this rank -> [L, b, ...] of the whole row, in row order. Every rank's
    queries read them all: the backward sums their gradients and gives each rank its own part (reduce-scatter)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    group = _group()
    gathered = gather_from_sequence_parallel_region(t.contiguous(), tensor_parallel_output_grad=True, group=group)
    return gathered.index_select(0, gathered_order(gathered.shape[0], group.size(), t.device))


@dataclass
class LocalRows:
    """What the model reads on one CP rank: its positions of the rows (`packing.ModelRows` in row layout)."""

    input_ids: torch.Tensor  # [r, L / CP]
    position_ids: torch.Tensor  # [r, L / CP]: each token's position within its sample, as in the whole row
    attention_mask: torch.Tensor  # [r or 1, 1, L / CP, L] bool, True = masked: this rank's query rows
    next_ids: torch.Tensor  # [r, L / CP]: the token after each held position in the whole row (0 after the last)


class ContextSplit:
    """This rank's part of the context-parallel group: what it holds of a row, and whole rows back from every part."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    @classmethod
    def current(cls) -> "ContextSplit":
        """This process's part of Megatron's context-parallel group (the whole rows at --context-parallel-size 1)."""
        from megatron.core import parallel_state as ps

        return cls(ps.get_context_parallel_world_size(), ps.get_context_parallel_rank())

    @property
    def row_multiple(self) -> int:
        """Row lengths must be a multiple of this: 2 chunks per rank."""
        return 2 * self.size if self.size > 1 else 1

    def positions(self, length: int, device=None) -> torch.Tensor:
        return row_positions(length, self.size, self.rank, device)

    def local_rows(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   attention_mask: torch.Tensor) -> LocalRows:
        """This rank's positions of whole rows `input_ids` [r, L] (position ids alike, mask [r or 1, 1, L, L])."""
        next_ids = torch.roll(input_ids, -1, dims=1)
        next_ids[:, -1] = 0
        if self.size == 1:
            return LocalRows(input_ids, position_ids, attention_mask, next_ids)
        held = self.positions(input_ids.shape[1], input_ids.device)
        return LocalRows(input_ids=input_ids[:, held], position_ids=position_ids[:, held],
                         attention_mask=attention_mask[:, :, held], next_ids=next_ids[:, held])

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's part of a per-position tensor (`dim`: its position dimension) -> whole rows, in row order.
        The same values on every CP rank, and each computes the same loss from them: the backward keeps this rank's
        own positions' gradient, unsummed."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if self.size == 1:
            return x
        moved = x.movedim(dim, 0)
        gathered = gather_from_sequence_parallel_region(moved.contiguous(), tensor_parallel_output_grad=False,
                                                        group=_group())
        ordered = gathered.index_select(0, gathered_order(gathered.shape[0], self.size, x.device))
        return ordered.movedim(0, dim)
