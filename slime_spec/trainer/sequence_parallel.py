"""Sequence parallelism, for MoE models under tensor parallelism: megatron-core 0.16.1's MoE layer trains under TP
only with it (moe_layer.py refuses a training forward otherwise).

With `sequence_parallel=True` megatron-core's own layers do the work: the embedding scatters the sequence over the TP
ranks, each column-parallel linear all-gathers it, each row-parallel linear reduce-scatters it, and the MoE layer's
token dispatcher gathers the tokens over TP x EP. What the trainer's local layer spec lacks:
- a norm that runs on a sequence shard: the spec's `WrappedTorchNorm` refuses sequence parallelism, although an
  RMSNorm computes each token alone; `SequenceParallelNorm` is the same torch RMSNorm without that refusal;
- the gradient of a weight every TP rank holds whole but applies to its own tokens only (those norms, the MoE
  router): each rank's is a partial sum, added up over the TP group as Megatron's finalize_model_grads does for
  parameters marked `sequence_parallel`;
- every row's length a multiple of the TP size (the trainer pads rows: `step_plan.row_lengths`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


class SequenceParallelNorm:
    """megatron-core's torch RMSNorm (`WrappedTorchNorm`), allowed on a sequence shard; its weight is marked
    `sequence_parallel` so that its gradient is summed over the TP group."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization {config.normalization!r}: the trainer builds RMSNorm models only")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = True
        return norm


def with_sequence_parallel_norms(spec):
    """A copy of a layer spec (ModuleSpec and its submodules, recursively) with every torch norm replaced by
    `SequenceParallelNorm`."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SequenceParallelNorm
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=with_sequence_parallel_norms(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: with_sequence_parallel_norms(getattr(spec, f.name))
                                            for f in dataclasses.fields(spec)})
    if isinstance(spec, list):
        return [with_sequence_parallel_norms(s) for s in spec]
    return spec


def block_spec(layer_spec, num_layers: int):
    """The decoder block of `num_layers` such layers, its final norm a `SequenceParallelNorm` (megatron-core builds
    the final norm of a bare layer spec from its module-level choice, the torch norm that refuses)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if isinstance(layer_spec, TransformerBlockSubmodules):
        return dataclasses.replace(with_sequence_parallel_norms(layer_spec), layer_norm=SequenceParallelNorm)
    return TransformerBlockSubmodules(layer_specs=[with_sequence_parallel_norms(layer_spec)] * num_layers,
                                      layer_norm=SequenceParallelNorm)


def sum_sequence_parallel_grads_over_tp(model) -> None:
    """Add up over the TP group, as each backward produces them, the gradients of the weights marked
    `sequence_parallel` (norms on a sequence shard, the MoE router); the q/k norms are summed already
    (model.sum_qk_norm_grads_over_tp: each rank normalizes its own heads)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for name, param in model.named_parameters():
        if getattr(param, "sequence_parallel", False) and not name.endswith(("q_layernorm.weight",
                                                                              "k_layernorm.weight")):
            param.register_hook(summed)


def mla_kv_down_proj_full_width(model) -> None:
    """Multi-latent attention's KV down-projection, sequence-sharded and full-width, as a duplicated linear would
    give it. In megatron-core 0.16.1's local spec it is a ColumnParallelLinear whose output the attention gathers
    over the TP ranks; the RoPE part of that output (k_pos_emb) is then used whole by every rank's heads, but the
    gather's backward keeps each rank's own columns of its own partial gradient, so the RoPE key's gradient misses
    the other ranks' heads. Given the full width on a sequence shard, the attention takes its other path: it
    gathers k_pos_emb over the sequence, whose backward sums the ranks' gradients (the weights stay column-split,
    so conversion and checkpoints are unchanged)."""
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    def full_width(linear):
        column_parallel = linear.forward

        def forward(hidden_states):
            out, bias = column_parallel(hidden_states)  # [s, b, width / TP]: the sequence gathered inside
            return scatter_to_sequence_parallel_region(gather_from_tensor_model_parallel_region(out)), bias
        return forward

    for module in model.modules():
        if isinstance(module, MLASelfAttention):
            module.linear_kv_down_proj.forward = full_width(module.linear_kv_down_proj)
