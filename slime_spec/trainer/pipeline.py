"""Pipeline stages (--pipeline-model-parallel-size): megatron-core's schedule over an optimizer step's micro-batches,
the stages' layer names, and what crosses stages outside the schedule.

Each stage builds its own decoder layers (megatron-core's specs slice them); the first also holds the embedding, the
last the final norm, the output layer and the MTP block, with its own copy of the embedding where the MTP block or a
tied output layer reads it (megatron-core marks that copy `shared`). Every step runs through
`get_forward_backward_func()`: one forward and backward per micro-batch without stages, 1F1B over the stages with
them, activations and their gradients passed between stages by megatron-core's point-to-point exchange. The loss,
its metrics and the MTP and draft losses are computed on the last stage only.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _ps():
    from megatron.core import parallel_state as ps
    return ps


def pp_size() -> int:
    return _ps().get_pipeline_model_parallel_world_size()


def layer_offset(model) -> int:
    """The number, in the whole model, of this stage's first decoder layer (megatron-core's `layer_number`
    counts from 1 over all stages)."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def global_layer_names(model) -> Callable[[str], str]:
    """Stage-local parameter name -> the whole model's (`decoder.layers.{i}` -> `decoder.layers.{offset + i}`)."""
    offset = layer_offset(model)
    if offset == 0:
        return lambda name: name
    return lambda name: _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name, count=1)


def on_this_stage(name: str, model) -> bool:
    """Whether this stage holds the weight a whole-model Megatron name `name` denotes."""
    m = _LAYER.match(name)
    if m:
        offset = layer_offset(model)
        return offset <= int(m.group(1)) < offset + len(model.decoder.layers)
    if name.startswith("embedding."):
        return hasattr(model, "embedding")
    if name.startswith("mtp."):
        return bool(getattr(model, "mtp_process", False))
    if name.startswith(("decoder.final_layernorm.", "output_layer.")):
        return bool(model.post_process)
    return True


def is_stage_copy(param: torch.Tensor) -> bool:
    """The last stage's copy of the embedding (megatron-core's `shared` mark): the first stage's is the weight."""
    return bool(getattr(param, "shared", False))


def run_schedule(model, batches: list, forward: Callable[[int, Any], tuple[torch.Tensor, Callable | None]],
                 forward_only: bool, timers=None) -> list[dict]:
    """megatron-core's schedule over `batches` (one optimizer step's micro-batches, or a forward-only pass).

    `forward(m_idx, batch)` runs this stage's part of micro-batch `m_idx` and returns its output tensor and, on
    the last stage, `loss()` -> (the scalar to backpropagate, a dict of results). The scalar is taken as it is:
    the model's config sets `calculate_per_token_loss`, so the schedule neither divides it by the number of
    micro-batches nor by a token count. Returns the last stage's result dicts in micro-batch order ([] elsewhere).
    `timers`: megatron-core's timer interface (timing.PartTimer.megatron), or None."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, _model):
        m_idx, batch = next(data_iterator)
        output, loss = forward(m_idx, batch)

        def loss_func(_output):
            value, results = loss()
            return value, torch.zeros((), dtype=torch.int), results

        return output, loss_func

    config = model.config
    if not config.calculate_per_token_loss:
        raise RuntimeError("the trainer's model config must set calculate_per_token_loss (its losses are sums)")
    config.timers = timers
    try:
        # seq_length and micro_batch_size size the tensors passed between stages only when the config does not
        # set variable_seq_lengths; build_gpt_model sets it (each micro-batch's rows have their own length)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(enumerate(batches)), model=model,
            num_microbatches=len(batches), seq_length=0, micro_batch_size=0, forward_only=forward_only)
    finally:
        config.timers = None


def run_forward(model, batches: list, forward: Callable[[int, Any], tuple[torch.Tensor, dict | None]]) -> list[dict]:
    """`run_schedule` without a backward pass: `forward(m_idx, batch)` returns this stage's output tensor and, on the
    last stage, the micro-batch's results; the last stage's results in micro-batch order ([] elsewhere)."""
    def with_no_loss(m_idx, batch):
        output, results = forward(m_idx, batch)
        return output, None if results is None else (lambda: (output.new_zeros(()), results))

    return run_schedule(model, batches, with_no_loss, forward_only=True)


def sum_shared_embedding_grads(params: list[torch.Tensor]) -> None:
    """Add up the gradients of the first stage's embedding and the last stage's copy (megatron-core marks both
    `shared_embedding`), so both apply the same update and stay equal (what Megatron's finalize_model_grads does
    over its embedding group). A copy without a gradient this step counts as zero."""
    if pp_size() == 1:
        return
    ps = _ps()
    for p in params:
        if getattr(p, "shared_embedding", False):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=ps.get_embedding_group())


def sum_over_stages(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """`tensor` summed over this rank's pipeline stages, in place (what only the last stage computes, with zeros on
    the others, becomes every stage's); through `device` when given (NCCL reduces CUDA tensors only)."""
    if pp_size() > 1:
        moved = tensor if device is None else tensor.to(device)
        dist.all_reduce(moved, group=_ps().get_pipeline_model_parallel_group())
        if moved is not tensor:
            tensor.copy_(moved)
    return tensor


def from_last_stage(obj):
    """The last stage's `obj`, on every stage of this rank's pipeline."""
    if pp_size() == 1:
        return obj
    group = _ps().get_pipeline_model_parallel_group()
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[-1], group=group)
    return box[0]


def stage_layer_counts(num_layers: int, stages: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Decoder layers per stage as megatron-core lays them out: `first` / `last` on the first / last stage where
    given (--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers), the rest split evenly over
    the other stages. ValueError naming the flags when they do not split."""
    given = {0: first, stages - 1: last} if stages > 1 else {}
    given = {s: n for s, n in given.items() if n is not None}
    rest, others = num_layers - sum(given.values()), stages - len(given)
    where = (f"{num_layers} decoder layers over --pipeline-model-parallel-size {stages}"
             + "".join(f" with {flag} {n}" for flag, n in (("--decoder-first-pipeline-num-layers", first),
                                                          ("--decoder-last-pipeline-num-layers", last))
                       if n is not None))
    if rest < 0 or (others == 0 and rest != 0) or (others and (rest % others or rest // others < 1)):
        raise ValueError(f"{where}: the stages cannot hold them evenly (each stage needs at least one layer, the "
                         f"stages without a given count an equal share); choose sizes that split the layers")
    return [given.get(s, rest // others if others else 0) for s in range(stages)]


def weights_to_first_stage(tensors: Iterable, device: torch.device) -> Iterator:
    """The weight sync's stream (gather.NamedTensor, each whole) of every stage, on global rank 0.

    Rank 0 yields its own stage's tensors, then those of each later stage in turn, which the ranks of global rank
    0's pipeline group send it one by one (a header object, then the tensor); on those ranks this yields nothing.
    Other ranks' streams pass through (they take part in their stage's tensor- and expert-parallel gathers only).
    """
    if pp_size() == 1:
        yield from tensors
        return
    group = _ps().get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    if ranks[0] != 0:
        yield from tensors
        return
    if dist.get_rank() != 0:
        for _ in _send_stage(tensors, lambda header: dist.send_object_list(header, dst=0, group=group),
                             lambda tensor: dist.send(tensor, dst=0, group=group)):
            pass
        return
    yield from tensors
    for stage, src in enumerate(ranks[1:], start=1):
        yield from _receive_stage(stage, src, device,
                                  lambda header, src=src: dist.recv_object_list(header, src=src, group=group),
                                  lambda tensor, src=src: dist.recv(tensor, src=src, group=group))


def weights_of_every_stage(tensors: Iterable, device: torch.device) -> Iterator:
    """The weight sync's stream (gather.NamedTensor, each whole) of every stage, on every rank: each stage in turn
    broadcasts its tensors over the pipeline group (a header object, then the tensor). For colocated engines fed by
    the trainer rank on their own GPU (SGLang opens a CUDA IPC handle only on a device the engine sees), where every
    such rank needs the whole model."""
    if pp_size() == 1:
        yield from tensors
        return
    ps = _ps()
    group = ps.get_pipeline_model_parallel_group()
    ranks, stage = dist.get_process_group_ranks(group), ps.get_pipeline_model_parallel_rank()
    for src_stage, src in enumerate(ranks):
        def header_of(header, src=src):
            dist.broadcast_object_list(header, src=src, group=group)

        def tensor_of(tensor, src=src):
            dist.broadcast(tensor, src=src, group=group)

        if src_stage == stage:
            yield from _send_stage(tensors, header_of, tensor_of)
        else:
            yield from _receive_stage(src_stage, src, device, header_of, tensor_of)


_FAILED = "stage failed"


def _send_stage(tensors: Iterable, send_header: Callable[[list], None],
                send_tensor: Callable[[torch.Tensor], None]) -> Iterator:
    """Send each of this stage's tensors (a header, then the tensor), yielding it once sent; then the end marker. A
    stream that fails (a gather, a conversion) sends a failure header and raises: the receivers fail naming this
    stage instead of waiting for tensors that never come."""
    try:
        for t in tensors:
            send_header([(t.name, t.tensor.shape, t.tensor.dtype, t.kind)])
            send_tensor(t.tensor.contiguous())
            yield t
    except Exception as e:
        send_header([(_FAILED, f"{type(e).__name__}: {e}")])
        raise
    send_header([None])


def _receive_stage(stage: int, rank: int, device: torch.device, receive_header: Callable[[list], None],
                   receive_tensor: Callable[[torch.Tensor], None]) -> Iterator:
    """Stage `stage`'s tensors (sent by trainer rank `rank` through `_send_stage`), each into a new tensor on
    `device`, until its end marker."""
    from slime_spec.weight_sync.gather import NamedTensor

    while True:
        header = [None]
        receive_header(header)
        if header[0] is None:
            return
        if header[0][0] == _FAILED:
            raise RuntimeError(f"pipeline stage {stage} (trainer rank {rank}) failed sending its weights: "
                               f"{header[0][1]}")
        name, shape, dtype, kind = header[0]
        tensor = torch.empty(shape, dtype=dtype, device=device)
        receive_tensor(tensor)
        yield NamedTensor(name, tensor, kind)
