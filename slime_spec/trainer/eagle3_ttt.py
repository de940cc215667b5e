"""EAGLE3's training-time test: the draft unrolled over several steps on the target's own features.

At step k the draft row position i reads token i+1+k (the target's embedding) and, for k = 0, the target's
aux hidden states at i (through fc), for k > 0 its own step k-1 output at i; it predicts token i+2+k,
trained towards the target's distribution at position i+1+k restricted to the draft vocabulary (t2d).
Attention at step k sees the step-0 keys of the row's context (causal, or block-diagonal when packed)
plus, at its own position only, the keys of steps 1..k: what the draft sees when it drafts k tokens ahead.
A position counts when its predicted token is a trained response token of the same sample and the
target's top token is in the draft vocabulary; step k is weighted by decay ** k (EAGLE3 / SpecForge use 0.8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from slime_spec.common.eagle3_draft import Eagle3Draft

STEP_DECAY = 0.8


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar: sum over steps of decay**k * mean cross-entropy of step k
    step_losses: list[float]
    step_accuracy: list[float]  # draft top-1 == target top-1 over counted positions, per step
    counted: list[int]  # positions counted per step


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, i + k] at i (zeros past the end), along dim 1."""
    if k == 0:
        return x
    pad = torch.zeros_like(x[:, :k])
    return torch.cat([x[:, k:], pad], dim=1)


def _attend(q, keys, values, first_mask) -> torch.Tensor:
    """q [b, h, s, d] over the step-0 keys (masked by first_mask [b|1, 1, s, s], True = hidden) and the
    same-position keys of later steps; keys/values [b, kv, s, d] per step."""
    groups = q.shape[1] // keys[0].shape[1]
    expand = [(k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)) for k, v in zip(keys, values)]
    scale = 1.0 / math.sqrt(q.shape[-1])
    first = (q @ expand[0][0].transpose(-1, -2)) * scale
    first = first.masked_fill(first_mask, float("-inf"))
    diag = [(q * k).sum(-1, keepdim=True) * scale for k, _ in expand[1:]]
    probs = torch.softmax(torch.cat([first] + diag, dim=-1).float(), dim=-1).to(q.dtype)
    s = q.shape[2]
    out = probs[..., :s] @ expand[0][1]
    for j, (_, v) in enumerate(expand[1:]):
        out = out + probs[..., s + j:s + j + 1] * v
    return out


def ttt_loss(draft: Eagle3Draft, embeds: torch.Tensor, aux_hidden: torch.Tensor, target_logits: torch.Tensor,
             position_ids: torch.Tensor, loss_mask: torch.Tensor, steps: int,
             attention_mask: torch.Tensor | None = None, decay: float = STEP_DECAY) -> TTTResult:
    """The draft's TTT loss on rows of the target's features (all detached from the target).

    embeds [b, s, H] target embeddings of the row tokens; aux_hidden [b, s, n*Ht]; target_logits [b, s, V]
    (position i predicts token i+1); position_ids [b, s] (each sample from 0); loss_mask [b, s] 1 on
    trained tokens (aligned to tokens); attention_mask [b|1, 1, s, s] True = masked (default causal).
    """
    if steps < 1:
        raise ValueError(f"--draft-ttt-steps {steps}: give at least 1")
    b, s, _ = embeds.shape
    if attention_mask is None:
        attention_mask = torch.ones(s, s, dtype=torch.bool, device=embeds.device).triu(1)[None, None]
    t2d = draft.t2d
    dtype = draft.fc.weight.dtype  # a --bf16 policy's features meet the draft's own (float32) precision
    embeds, aux_hidden = embeds.to(dtype), aux_hidden.to(dtype)
    target_logits = target_logits.detach().float()
    in_draft_vocab = t2d[target_logits.argmax(-1)]  # [b, s]: the target's top token can be drafted
    target_p = torch.softmax(target_logits[..., t2d], dim=-1)  # [b, s, Vd], draft id order (t2d ascending)
    hidden = draft.project(aux_hidden.detach())
    keys, values = [], []
    total = embeds.new_zeros(())
    losses, accs, counts = [], [], []
    for k in range(steps):
        emb = _shift(embeds.detach(), 1 + k)
        q, key, value = draft.qkv(emb, hidden, position_ids + k)
        keys.append(key)
        values.append(value)
        out = draft.finish(hidden, _attend(q, keys, values, attention_mask))
        logits = draft.logits(out)
        # position i predicts token i+2+k from the target's distribution at i+1+k
        same_sample = _shift(position_ids, 2 + k) == position_ids + 2 + k
        counted = same_sample & (_shift(loss_mask, 2 + k) > 0) & _shift(in_draft_vocab, 1 + k)
        n = int(counted.sum())
        target = _shift(target_p, 1 + k)
        ce = -(target * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        step_loss = (ce * counted).sum() / max(n, 1)
        total = total + (decay ** k) * step_loss
        with torch.no_grad():
            hit = (logits.argmax(-1) == target.argmax(-1)) & counted
            accs.append(float(hit.sum()) / max(n, 1))
        losses.append(float(step_loss.detach()))
        counts.append(n)
        hidden = out
    return TTTResult(total, losses, accs, counts)
