"""What the model reads for one micro-batch: padded rows (one sample each) or one packed row.

The loss math reads per-token tensors in *sample layout* [n, S] (`batch.TokenBatch`, entry j of row i is
token j of sample i). The model reads `ModelRows`: right-padded rows, or every sample of the micro-batch
concatenated into one row with per-sample position ids and a block-diagonal causal mask, so no sample
attends to another and no padding is computed. `to_samples` maps per-token model outputs back to
sample layout; entries a sample's own context cannot produce (its column 0, and past its end) are 0.

Why a mask and not THD/cu_seqlens: megatron-core's local (non-TransformerEngine) DotProductAttention
refuses `packed_seq_params`, and this trainer runs without TransformerEngine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime_spec.trainer.batch import TokenBatch


@dataclass
class ModelRows:
    input_ids: torch.Tensor  # [r, L] long
    position_ids: torch.Tensor  # [r, L] long: each sample counts from 0
    attention_mask: torch.Tensor  # [r or 1, 1, L, L] bool, True = masked (Megatron's convention)
    index: torch.Tensor  # [n, S] long: flat row position (row * L + t) of sample i's token j (0 past its end)
    valid: torch.Tensor  # [n, S] bool: j < length of sample i

    @property
    def n_tokens(self) -> int:
        """Token positions the model computes (padding included)."""
        return self.input_ids.numel()

    def to_samples(self, per_token: torch.Tensor) -> torch.Tensor:
        """[r, L] per-token values aligned to target tokens -> [n, S]; 0 in column 0 and past each sample.

        Column 0 of a packed sample holds a prediction from the previous sample's last token: never used.
        """
        out = per_token.reshape(-1)[self.index]
        keep = self.valid.clone()
        keep[:, 0] = False
        return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))

    def to_rows(self, per_sample: torch.Tensor) -> torch.Tensor:
        """[n, S] per-token values of the samples -> the rows' layout [r, L] (0 on padding)."""
        flat = torch.zeros(self.input_ids.numel(), dtype=per_sample.dtype, device=per_sample.device)
        flat[self.index[self.valid]] = per_sample[self.valid]
        return flat.view_as(self.input_ids)


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """[1, 1, s, s] True above the diagonal: right padding needs nothing more."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def padded_rows(batch: TokenBatch) -> ModelRows:
    """One right-padded row per sample (the layout of `batch` itself)."""
    return equal_rows(batch.input_ids, batch.lengths)


def equal_rows(input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> ModelRows:
    """One row per sample of token rows [n, s]: sample i's first lengths[i] positions (all s without `lengths`)."""
    n, s = input_ids.shape
    device = input_ids.device
    cols = torch.arange(s, device=device)
    valid = torch.ones(n, s, dtype=torch.bool, device=device) if lengths is None else cols[None] < lengths[:, None]
    return ModelRows(input_ids=input_ids, position_ids=cols[None].expand(n, s), attention_mask=causal_mask(s, device),
                     index=torch.arange(n * s, device=device).view(n, s), valid=valid)


def packed_rows(batch: TokenBatch, min_len: int = 0) -> ModelRows:
    """Every sample of `batch` concatenated into one row, attention block-diagonal and causal; `min_len`: padded
    to at least that many tokens (a segment of its own after the samples, which no sample attends to)."""
    lengths = batch.lengths
    device = batch.input_ids.device
    n, s = batch.input_ids.shape
    cols = torch.arange(s, device=device)
    valid = cols[None] < lengths[:, None]
    starts = torch.cumsum(lengths, 0) - lengths
    pad = max(0, min_len - int(lengths.sum()))
    segment = torch.repeat_interleave(torch.arange(n + 1, device=device),
                                      torch.cat([lengths, torch.tensor([pad], device=device)]))
    position_ids = torch.cat([torch.arange(int(k), device=device) for k in [*lengths.tolist(), pad]])
    causal = causal_mask(len(segment), device)[0, 0]
    other_sample = segment[:, None] != segment[None, :]
    input_ids = torch.cat([batch.input_ids[valid], batch.input_ids.new_zeros(pad)])
    return ModelRows(input_ids=input_ids[None], position_ids=position_ids[None],
                     attention_mask=(causal | other_sample)[None, None],
                     index=torch.where(valid, starts[:, None] + cols[None], 0), valid=valid)


def model_rows(batch: TokenBatch, packed: bool, min_len: int = 0) -> ModelRows:
    """`min_len`: a packed row's least length (padded rows are as long as `batch`'s)."""
    return packed_rows(batch, min_len) if packed else padded_rows(batch)
