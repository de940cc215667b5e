"""A train_step's metrics: per-sample sums accumulated over micro-batches, then means over data-parallel ranks.

The sums are one float64 vector: METRICS, then the sample count (the trained-token count under
--calculate-per-token-loss, whose metrics are token means, as slime's), then the summed |old - rollout| log-prob
difference and its token count (train_rollout_logprob_abs_diff, where the rollout returned log-probs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slime_spec.trainer import losses
from slime_spec.trainer.batch import TokenBatch

METRICS = ("loss", "pg_loss", "kl", "clip_fraction", "entropy", "mtp_loss", "tis", "tis_clipfrac", "tis_abs")
TIS_METRICS = ("tis", "tis_clipfrac", "tis_abs")  # reported with --use-tis only, as slime's train/tis*


def new_sums() -> torch.Tensor:
    return torch.zeros(len(METRICS) + 3, dtype=torch.float64)  # METRICS, n_samples, |lp diff|, n_tokens


def accumulate(sums: torch.Tensor, terms: losses.LossTerms, batch: TokenBatch,
               old_log_probs: torch.Tensor | None, per_token: bool = False) -> None:
    """Add one micro-batch's loss terms (and, for a policy step, its log-prob difference to the rollout's); each
    sample's weighed by its trained tokens with `per_token`."""
    with torch.no_grad():
        weights = batch.loss_mask.sum(-1).double() if per_token else None
        for i, key in enumerate(METRICS):
            value = terms.total if key == "loss" else getattr(terms, key)
            if value is not None:  # the TIS terms are None without --use-tis
                value = value.detach().double()
                sums[i] += (value if weights is None else value * weights).sum().cpu()
        sums[len(METRICS)] += batch.input_ids.shape[0] if weights is None else weights.sum().cpu()
        if old_log_probs is not None and bool(batch.has_rollout_log_probs.any()):
            mask = batch.loss_mask * batch.has_rollout_log_probs[:, None]
            sums[-2] += ((old_log_probs - batch.rollout_log_probs).abs() * mask).sum().double().cpu()
            sums[-1] += mask.sum().double().cpu()


def step_metrics(sums: torch.Tensor, grad_norms: list[float], lr: float, dp_size: int,
                 device: torch.device, use_tis: bool = False) -> dict[str, float]:
    """Means over every data-parallel rank's samples, the mean gradient norm of the applied steps, and lr (the TIS
    terms with `use_tis` only)."""
    from megatron.core import parallel_state as ps

    if dp_size > 1:
        sums = sums.to(device)
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
        sums = sums.cpu()
    n = max(float(sums[len(METRICS)]), 1.0)
    metrics = {key: float(sums[i]) / n for i, key in enumerate(METRICS) if use_tis or key not in TIS_METRICS}
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else None  # None: every step skipped
    metrics["lr"] = lr
    if sums[-1] > 0:
        metrics["train_rollout_logprob_abs_diff"] = float(sums[-2] / sums[-1])
    return metrics
