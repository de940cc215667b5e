"""Loss math of the trainer, as pure tensor functions (the same formulas as slime's ppo_utils).

Shapes: per-token tensors are [batch, seq] aligned to *target* positions: entry j is about token j
(its log-prob under the model given tokens < j). Masks are 1.0 on the tokens that are trained.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


def grpo_advantages(rewards: Sequence[float], group_index: Sequence[int], n_samples_per_prompt: int,
                    std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-sample GRPO advantage: reward minus its group's mean, divided by the group's std (+eps).

    A group is the n_samples_per_prompt samples of one prompt (`Sample.group_index`). The std is torch's
    unbiased one, as slime computes it.
    """
    if len(rewards) != len(group_index):
        raise ValueError(f"{len(rewards)} rewards for {len(group_index)} samples")
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_index):
        members[g].append(i)
    r = torch.tensor([float(x) for x in rewards], dtype=torch.float32)
    adv = torch.empty_like(r)
    for g, idx in members.items():
        if len(idx) != n_samples_per_prompt:
            raise ValueError(f"GRPO: prompt group {g} has {len(idx)} samples but --n-samples-per-prompt is "
                             f"{n_samples_per_prompt}; pass every sample of each prompt to the trainer")
        group = r[idx]
        centered = group - group.mean()
        if std_normalize and len(idx) > 1:
            centered = centered / (group.std() + eps)
        adv[idx] = centered
    return adv


def whiten_advantages(advantages: torch.Tensor, trained_tokens: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """slime's --normalize-advantages (its `distributed_masked_whiten`, shift_mean=True): each sample's advantage
    counts once per token it trains; the result is (advantage - mean) / sqrt(var + eps) with the variance
    Bessel-corrected over two or more tokens. Every rank holds the whole rollout, so these are the statistics slime
    all-reduces over its data-parallel group. With no trained token the advantages are returned as they are."""
    n = trained_tokens.sum()
    if n == 0:
        return advantages
    mean = (advantages * trained_tokens).sum() / n
    var = (advantages.square() * trained_tokens).sum() / n - mean.square()
    if n >= 2:
        var = var * n / (n - 1)
    return (advantages - mean) * torch.rsqrt(var + eps)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits divided by the rollout temperature as slime does: SGLang returns the log-probs of the
    temperature-scaled distribution it sampled from, so the trainer's must be of the same one."""
    logits = logits.float()
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


def next_token_log_probs(logits: torch.Tensor, next_ids: torch.Tensor, temperature: float = 1.0,
                         with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """At each position i of logits [b, s, V]: log p(next_ids[:, i]) at `temperature`, and (`with_entropy`) the
    entropy of that distribution, from one float32 log-softmax (two would hold two [b, s, V] float32 copies
    for the backward). Per position, so a context-parallel rank computes its own positions
    (`context_parallel.LocalRows.next_ids`)."""
    logp = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    lp = logp.gather(-1, next_ids[..., None]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1) if with_entropy else None


def to_token_positions(per_position: torch.Tensor) -> torch.Tensor:
    """[b, s] values of the distribution at position i (which predicts token i + 1) -> at token i + 1; column 0
    (no context) is 0."""
    return F.pad(per_position[:, :-1], (1, 0))


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[b, s] log p(input_ids[:, j] | input_ids[:, <j]) from logits [b, s, V] (position i predicts i+1) at
    `temperature`; column 0 (no context) is 0."""
    return F.pad(next_token_log_probs(logits[:, :-1], input_ids[:, 1:], temperature)[0], (1, 0))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[b, s] entropy of the distribution that predicts token j (aligned like `token_log_probs`)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return F.pad(-(logp.exp() * logp).sum(-1), (1, 0))


def token_log_probs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor,
                                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_log_probs` and `token_entropy` at `temperature` (`next_token_log_probs`)."""
    lp, ent = next_token_log_probs(logits[:, :-1], input_ids[:, 1:], temperature, with_entropy=True)
    return F.pad(lp, (1, 0)), F.pad(ent, (1, 0))


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(policy || ref) estimators (Schulman, "Approximating KL divergence"); k3 == low_var_kl,
    the latter clamped to [-10, 10] as slime does."""
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return log_ratio.pow(2) / 2.0
    if kl_type in ("k3", "low_var_kl"):
        kl = (-log_ratio).exp() - 1 + log_ratio
        return kl.clamp(-10, 10) if kl_type == "low_var_kl" else kl
    raise ValueError(f"--kl-loss-type {kl_type!r}: choose one of {KL_TYPES}")


def ppo_clip_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                  eps_clip: float, eps_clip_high: float | None = None,
                  eps_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate (to minimise) and whether the clip was active (1.0/0.0).

    ratio = exp(log_probs - old_log_probs), clipped to [1 - eps_clip, 1 + eps_clip_high]. With `eps_clip_c`
    (dual-clip PPO, as slime's compute_policy_loss) a negative advantage's loss is at most -eps_clip_c * advantage,
    however far the ratio grew; the clip fraction counts the first clip only, as slime's does. The bound (> 1) is
    checked once, where the run's flags are (doctor's FLAG_OUT_OF_RANGE).
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = (log_probs - old_log_probs).exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + high) * advantages
    loss = torch.maximum(unclipped, clipped)
    if eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(-eps_clip_c * advantages, loss), loss)
    return loss, (clipped > unclipped).float()


def sample_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[b] mean of each sample's values over its masked tokens (0 for a sample with none)."""
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def mtp_token_losses(mtp_logits: list[torch.Tensor], input_ids: torch.Tensor,
                     loss_mask: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per MTP layer k: (cross-entropy [b, s-k-2], its mask). Position i of layer k predicts token i+k+2;
    only targets that are trained tokens (loss_mask, i.e. the response the draft will propose) count."""
    out = []
    for k, logits in enumerate(mtp_logits):
        shift = k + 2
        targets = input_ids[:, shift:]
        ce = F.cross_entropy(logits[:, :-shift].float().transpose(1, 2), targets, reduction="none")
        out.append((ce, loss_mask[:, shift:]))
    return out


def mtp_target_losses(mtp_logits: list[torch.Tensor], input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per MTP layer k: [b, s] cross-entropy aligned to *target* positions (entry j: layer k predicting
    token j from position j-k-2; 0 for j < k+2), so packed rows can be mapped back to samples like log-probs."""
    return [F.pad(ce, (k + 2, 0)) for k, (ce, _) in
            enumerate(mtp_token_losses(mtp_logits, input_ids, torch.ones_like(input_ids, dtype=torch.float32)))]


def mtp_loss_from_targets(target_losses: list[torch.Tensor], loss_mask: torch.Tensor) -> torch.Tensor:
    """[b] MTP loss from `mtp_target_losses` in sample layout: targets a layer reaches from inside the
    sample (j >= k+2) that are trained tokens, averaged per sample, then over layers."""
    per_layer = []
    for k, ce in enumerate(target_losses):
        mask = loss_mask.clone()
        mask[:, :k + 2] = 0
        per_layer.append(sample_mean(ce, mask))
    return torch.stack(per_layer).mean(0)


@dataclass
class LossTerms:
    """Per-sample terms of one micro-batch ([b] each); `total` is what is minimised per sample. The TIS terms are
    the importance weights before clipping, the share of tokens clipped and |weight - 1| (None without --use-tis)."""

    total: torch.Tensor
    pg_loss: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    clip_fraction: torch.Tensor
    mtp_loss: torch.Tensor
    tis: torch.Tensor | None = None
    tis_clipfrac: torch.Tensor | None = None
    tis_abs: torch.Tensor | None = None


@dataclass(frozen=True)
class TisWeights:
    """slime's truncated importance sampling (--use-tis): the rollout was sampled by the engine, whose log-probs
    differ from the trainer's old policy (kernels, precision), so each token's policy loss is weighted by
    w = exp(old - rollout log-prob), clipped to [clip_low, clip]; the weights carry no gradient."""

    clip: float
    clip_low: float

    def __call__(self, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(clipped weights, weights before clipping), per token."""
        with torch.no_grad():
            raw = (old_log_probs - rollout_log_probs).exp()
            return raw.clamp(min=self.clip_low, max=self.clip), raw


def policy_loss_terms(log_probs, old_log_probs, advantages, loss_mask, *, eps_clip: float,
                      eps_clip_high: float | None, entropy: torch.Tensor, entropy_coef: float,
                      eps_clip_c: float | None = None,
                      ref_log_probs: torch.Tensor | None = None, kl_loss_coef: float = 0.0,
                      kl_loss_type: str = "low_var_kl", tis: TisWeights | None = None,
                      rollout_log_probs: torch.Tensor | None = None) -> LossTerms:
    """GRPO/PPO objective: pg_loss + kl_loss_coef * KL(policy || ref) - entropy_coef * entropy; with `tis`, each
    token's pg term weighted by its truncated importance weight against `rollout_log_probs` (as slime's
    vanilla TIS)."""
    pg, clipped = ppo_clip_loss(log_probs, old_log_probs, advantages, eps_clip, eps_clip_high, eps_clip_c)
    tis_terms = {}
    if tis is not None:
        weights, raw = tis(old_log_probs, rollout_log_probs)
        pg = pg * weights
        tis_terms = dict(tis=sample_mean(raw, loss_mask), tis_clipfrac=sample_mean((weights != raw).float(), loss_mask),
                         tis_abs=sample_mean((raw - 1).abs(), loss_mask))
    pg_loss = sample_mean(pg, loss_mask)
    ent = sample_mean(entropy, loss_mask)
    kl = (sample_mean(approx_kl(log_probs, ref_log_probs, kl_loss_type), loss_mask)
          if ref_log_probs is not None else torch.zeros_like(pg_loss))
    total = pg_loss + kl_loss_coef * kl - entropy_coef * ent
    zero = torch.zeros_like(pg_loss)
    return LossTerms(total, pg_loss, kl, ent, sample_mean(clipped, loss_mask), zero, **tis_terms)


def sft_loss_terms(log_probs, loss_mask, entropy: torch.Tensor) -> LossTerms:
    """Negative log-likelihood of the trained tokens, per sample."""
    nll = sample_mean(-log_probs, loss_mask)
    zero = torch.zeros_like(nll)
    return LossTerms(nll, nll, zero, sample_mean(entropy, loss_mask), zero, zero)


def mtp_loss_per_sample(mtp_logits: list[torch.Tensor], input_ids: torch.Tensor,
                        loss_mask: torch.Tensor) -> torch.Tensor:
    """[b] MTP cross-entropy averaged over each sample's trained targets, then over MTP layers."""
    return mtp_loss_from_targets(mtp_target_losses(mtp_logits, input_ids), loss_mask)
