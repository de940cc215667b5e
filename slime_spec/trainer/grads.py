"""An optimizer step's gradients across ranks: the data-parallel sum, and clipping by the global norm.

The float32 master gradients (precision.MasterParams) are summed over the data-parallel x context-parallel group;
the norm counts a tensor-parallel shard once per shard and a replicated tensor once, as Megatron's clip_grad_norm
does. Under expert parallelism a routed expert's parameter (megatron-core marks it `allreduce=False`) already holds
the gradient of every EP rank's tokens (the token dispatcher's all-gather sums them back in its backward), so it is
summed over the expert-data-parallel group only, and its square counts once per expert (summed over the expert TP x EP
group). Pipeline stages each add their own layers' squares (the embedding's once, on the first stage).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def reduce_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum the gradients over data-parallel x context-parallel ranks (each context-parallel rank holds its own
    positions' share; an EP-split expert's over its expert-data-parallel ranks, which include them); returns the
    parameters that have one."""
    from megatron.core import parallel_state as ps

    params = [p for p in params if p.grad is not None]
    if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        edp_size = ps.get_expert_data_parallel_world_size()
        for p in params:
            if is_ep_split(p):
                if edp_size > 1:
                    dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
            else:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group(with_context_parallel=True))
    return params


def is_ep_split(param: torch.Tensor) -> bool:
    """A routed expert's parameter under expert parallelism: each EP rank holds other experts."""
    return getattr(param, "allreduce", True) is False


def clip_by_global_norm(params: list[torch.Tensor], clip_grad: float | None, tp_size: int,
                        device: torch.device) -> float:
    """Scale the gradients down to `clip_grad` when their global norm is above it; returns the norm.

    A non-finite norm is never clipped (`nan > clip` is false): the trainer skips that step instead."""
    from megatron.core import parallel_state as ps

    from slime_spec.trainer import pipeline

    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    experts = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if pipeline.is_stage_copy(p):  # the last stage's copy of the embedding: counted on the first stage
            continue
        sq = p.grad.double().pow(2).sum()
        if is_ep_split(p):
            experts += sq
        elif getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if tp_size > 1:
        dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
    if ps.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(experts, group=ps.get_expert_tensor_and_model_parallel_group())
    norm = float(pipeline.sum_over_stages(sharded + replicated + experts).sqrt())
    if clip_grad and clip_grad > 0 and math.isfinite(norm) and norm > clip_grad:
        scale = clip_grad / (norm + 1e-6)
        for p in params:
            p.grad.mul_(scale)
    return norm
