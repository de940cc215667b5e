"""The MTP layers' loss without their full logits: the shared output layer and the cross-entropy fused and
chunked over tokens, evaluated only where a target is trained.

Why: the naive loss materialises [tokens, vocab] logits, their float32 copy, the log-softmax and, in the
backward, a float32 gradient of the same size for every token of the micro-batch, prompts and padding
included; at a 151k vocabulary that dwarfs the MTP layer itself. Here each chunk's logits live only inside
`LinearCrossEntropy.forward`, which also computes the gradient for the hidden states (the output layer is
frozen for MTP training: the draft follows the policy's head and never moves it), so the backward is one
scale. Only positions whose target is a trained token (loss_mask) reach the head at all. The logits are
computed in the model's dtype and reduced in float32, as the naive `.float()` path does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime_spec.trainer.packing import ModelRows

CHUNK_ELEMENTS = 1 << 27  # float32 logits held per chunk: 512 MiB


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of `hidden @ weight.T` against `targets`, chunked over tokens.

    `weight` is this rank's vocabulary shard (rows `vocab_start` ...) and gets no gradient; vocabulary rows
    at or past `vocab_size` (Megatron's padding) are never a class. With a tensor-parallel `group` the
    softmax is reduced over the shards, as Megatron's vocab-parallel cross-entropy does.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_size: int, vocab_start: int, group):
        n_local = weight.shape[0]
        chunk = max(1, CHUNK_ELEMENTS // n_local)
        want_grad = ctx.needs_input_grad[0]
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grad else None
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < n_local)
        local_target = torch.where(mine, local_target, 0)
        padding_rows = vocab_start + torch.arange(n_local, device=hidden.device) >= vocab_size
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            logits = (h @ weight.t()).float().masked_fill_(padding_rows, float("-inf"))
            top = logits.max(-1).values
            _all_reduce(top, dist.ReduceOp.MAX, group)
            logits.sub_(top[:, None])
            target_logit = torch.where(mine[start:end], logits.gather(-1, local_target[start:end, None])[:, 0], 0.0)
            _all_reduce(target_logit, dist.ReduceOp.SUM, group)
            probs = logits.exp_()
            total = probs.sum(-1)
            _all_reduce(total, dist.ReduceOp.SUM, group)
            losses[start:end] = total.log() - target_logit
            if want_grad:  # d loss / d logits = softmax - one_hot(target)
                probs.div_(total[:, None])
                rows = torch.arange(end - start, device=hidden.device)
                probs[rows, local_target[start:end]] -= mine[start:end].float()
                g = probs.to(h.dtype) @ weight
                _all_reduce(g, dist.ReduceOp.SUM, group)
                grad_hidden[start:end] = g
        ctx.save_for_backward(grad_hidden)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_losses[:, None].to(grad_hidden.dtype), None, None, None, None, None


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                         vocab_start: int = 0, group=None) -> torch.Tensor:
    """[m] cross-entropy of the logits `hidden [m, h] @ weight.T` (one vocabulary shard per TP rank)."""
    return LinearCrossEntropy.apply(hidden, weight.detach(), targets, vocab_size, vocab_start, group)


@dataclass
class MTPTargets:
    """The trained targets of MTP layer k in one micro-batch, as flat positions of the model rows."""

    source: torch.Tensor  # [m] flat row position (row * L + t) whose hidden state predicts the target
    token: torch.Tensor  # [m] the target token id
    sample: torch.Tensor  # [m] which sample of the micro-batch it belongs to
    weight: torch.Tensor  # [m] its loss_mask value
    per_sample: torch.Tensor  # [n] sum of the weights of each sample (0 for a sample with none)


def mtp_targets(rows: ModelRows, loss_mask: torch.Tensor, k: int) -> MTPTargets:
    """MTP layer k at position i predicts token i + k + 2 of the same sample: its targets are the trained
    tokens j >= k + 2 of each sample (a packed sample's first tokens are never predicted from the one before)."""
    shift = k + 2
    mask = loss_mask * rows.valid
    mask[:, :shift] = 0
    sample, col = mask.nonzero(as_tuple=True)
    target = rows.index[sample, col]
    return MTPTargets(source=target - shift, token=rows.input_ids.reshape(-1)[target], sample=sample,
                      weight=mask[sample, col], per_sample=mask.sum(-1))


def mtp_loss_per_sample(mtp_hidden: list[torch.Tensor], output_weight: torch.Tensor, rows: ModelRows,
                        loss_mask: torch.Tensor, vocab_size: int, vocab_start: int = 0, group=None) -> torch.Tensor:
    """[n] MTP cross-entropy averaged over each sample's trained targets, then over the MTP layers (the
    same value as `losses.mtp_loss_per_sample` on the full logits). `mtp_hidden`: per layer [s, r, h]."""
    per_layer = []
    for k, hidden in enumerate(mtp_hidden):
        t = mtp_targets(rows, loss_mask, k)
        seq = rows.input_ids.shape[1]
        h = hidden[t.source % seq, t.source // seq]  # [m, h]
        ce = linear_cross_entropy(h, output_weight, t.token, vocab_size, vocab_start, group)
        summed = torch.zeros(loss_mask.shape[0], dtype=ce.dtype, device=ce.device).index_add(0, t.sample, ce * t.weight)
        per_layer.append(summed / t.per_sample.clamp(min=1))
    return torch.stack(per_layer).mean(0)
