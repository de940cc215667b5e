"""Which forwards of a model the embedded engine captures as CUDA graphs, on one memory pool: the target's decode
and verify forward (or, for EAGLE3, the one that also returns the aux layers' states), the whole plain decode step
(engine/model_executor/decode_graph.py), short prefills, and the MTP layer's forward and its greedy draft chains. The
mechanism (padding
to captured shapes, replay, capture) is engine/model_executor/cuda_graph.py's.
"""

from __future__ import annotations

from functools import partial

import torch

from slime_spec.engine.model_executor.cuda_graph import (
    CudaGraphSettings,
    ForwardFn,
    GraphedForward,
    capture_on_one_pool,
    key_buckets,
)
from slime_spec.engine.model_executor.decode_graph import DecodeStepGraph


def graph_model(model, cache, mtp_cache, settings: CudaGraphSettings, *, max_running_requests: int,
                max_draft_tokens: int, max_seq: int, capture: bool = True,
                aux_layer_ids: list[int] | None = None, chain_lengths: tuple[int, ...] = (),
                verify_widths: tuple[int, ...] | None = None,
                last_token: torch.Tensor | None = None, prefill: bool = False) -> dict[str, GraphedForward]:
    """Captured decode/verify forwards of `model` (and of its MTP layer when `mtp_cache` is given), on one
    memory pool. The caches hold one slot more than `max_running_requests`: the scratch slot of padded rows.
    Token counts: `verify_widths` (the step policy's: k + 1 for every k it may choose, 1 for a plain step); the MTP
    layer's those and 1 (its draft steps), and every width up to the widest where a policy takes plain steps (the
    extends deferred over them catch up at any width); None: every width up to max_draft_tokens + 1. A forward of
    another width runs eagerly.
    aux_layer_ids (EAGLE3): instead, the forward that also returns those layers' outputs, as "target_aux", its
    output the final hidden states and the aux states concatenated on the last dimension.
    chain_lengths: the k a greedy MTP draft chain may have (the step policy's `draft_lengths`), one
    `mtp_chain` graph each. last_token (the overlap schedule's token buffer, by slot): also the whole plain decode
    step, as "decode" (engine/model_executor/decode_graph.py). prefill: also short prefills ("prefill{t}",
    `prefill_graphs`)."""
    sizes = settings.capture_sizes(max_running_requests, speculative=max_draft_tokens > 0)
    widths = sorted(set(verify_widths)) if verify_widths else list(range(1, max_draft_tokens + 2))
    mtp_widths = list(range(1, widths[-1] + 1)) if widths[0] == 1 else [1, *widths]
    common = dict(batch_sizes=sizes, token_counts=widths, key_counts=key_buckets(max_seq),
                  scratch_slot=max_running_requests, device=model.lm_head.weight.device, capture=capture)
    compile_args = dict(compile_max_bs=settings.torch_compile_max_bs) if settings.torch_compile else {}

    def target(ids, positions, slots, num_keys, compiled=False):
        return model.eager_forward(ids, positions, cache, slots, num_keys, compiled=compiled, graphed=True)

    def compiled_target(ids, positions, slots, num_keys):
        return target(ids, positions, slots, num_keys, compiled=True)

    if aux_layer_ids:  # every target forward of an EAGLE3 engine asks for the aux states: no plain "target"
        def target_aux(ids, positions, slots, num_keys):
            hidden, aux = model.eager_forward(ids, positions, cache, slots, num_keys, graphed=True,
                                              aux_layer_ids=aux_layer_ids)
            return torch.cat((hidden, aux), dim=-1)

        graphs = {"target_aux": GraphedForward(target_aux, cache=cache, **common)}
    elif last_token is None or max_draft_tokens:  # plain decoding with the whole step captured needs no "target"
        graphs = {"target": GraphedForward(target, cache=cache, **common, **compile_args,
                                           compiled_fn=compiled_target if compile_args else None)}
    else:
        graphs = {}
    if last_token is not None and not aux_layer_ids:
        graphs["decode"] = DecodeStepGraph(model, cache, last_token, **common, **compile_args)
    if prefill and not aux_layer_ids and not settings.torch_compile:
        graphs.update(prefill_graphs(target, cache, sizes, max_seq, common))
    if mtp_cache is not None:
        def mtp(ids, positions, slots, num_keys, prev_hidden, compiled=False):
            return model.eager_mtp_forward(ids, prev_hidden, positions, mtp_cache, slots, num_keys=num_keys,
                                           compiled=compiled, graphed=True)

        def compiled_mtp(ids, positions, slots, num_keys, prev_hidden):
            return mtp(ids, positions, slots, num_keys, prev_hidden, compiled=True)

        hidden = ((model.args.hidden_size,), model.lm_head.weight.dtype)
        graphs["mtp"] = GraphedForward(mtp, cache=mtp_cache, extra={"prev_hidden": hidden},
                                       **{**common, "token_counts": mtp_widths}, **compile_args,
                                       compiled_fn=compiled_mtp if compile_args else None)
        for k in chain_lengths:
            graphs[mtp_chain_name(k)] = GraphedForward(partial(mtp_chain, model, mtp_cache, k), cache=mtp_cache,
                                                       extra={"prev_hidden": hidden}, **{**common, "token_counts": [1]})
    capture_on_one_pool(list(graphs.values()), settings.enable_cudagraph_gc)
    return graphs


PREFILL_TOKENS = (16, 32, 64, 128)  # prompt widths a prefill pads up to, one graph family each
PREFILL_MAX_BS = 8  # prefills of more rows run eagerly: their device time outweighs the host's


def prefill_graphs(target: ForwardFn, cache, sizes: list[int], max_seq: int, common: dict
                   ) -> dict[str, GraphedForward]:
    """Prefills of up to PREFILL_MAX_BS rows and 128 tokens, captured per width in PREFILL_TOKENS ("prefill{t}"):
    eagerly a 0.7B model's 32-token prefill launched about 300 ops, 15-30 ms of host time on an H100 host (a
    decode step is 1 ms), which at batch 1 was a fifth of a 128-token request. Padded positions write keys past the
    prompt that every later step overwrites before it reads them; keys read: the width itself."""
    small = [s for s in sizes if s <= PREFILL_MAX_BS]
    return {f"prefill{t}": GraphedForward(target, cache=cache, **{**common, "batch_sizes": small,
                                                                  "token_counts": [t], "key_counts": [t]})
            for t in PREFILL_TOKENS if small and t <= max_seq}


def prefill_graph(graphs: dict, rows: int, width: int) -> GraphedForward | None:
    """The captured prefill a batch of `rows` prompts of at most `width` tokens pads up to, or None (eager)."""
    for t in PREFILL_TOKENS:
        graph = graphs.get(f"prefill{t}")
        if t >= width and graph is not None:
            return graph if graph.shape_for(rows, t, t) is not None else None
    return None


def mtp_chain_name(k: int) -> str:
    return f"mtp_chain{k}"


def mtp_chain(model, mtp_cache, k: int, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              num_keys: int, prev_hidden: torch.Tensor) -> torch.Tensor:
    """A greedy MTP draft chain of k tokens [B, k] in one forward (captured as one graph, SGLang's EAGLE draft
    runner captures its draft steps together): the first from the lm_head over the hidden state the last extend
    left (prev_hidden [B, 1, H]), each further one from the MTP layer run on the previous token and its own output
    hidden, at positions[:, 0] + j - 1. ids: unused, the chain's tokens come from the hidden states. Every step reads
    num_keys keys (the last step's count): attention masks keys past each query's own position, so a step that
    needs fewer reads the same ones."""
    hidden, tokens = prev_hidden[:, 0], []
    for j in range(k):
        if j > 0:
            hidden = model.eager_mtp_forward(tokens[-1][:, None], hidden[:, None], positions + (j - 1), mtp_cache,
                                             slots, num_keys=num_keys, graphed=True)[:, 0]
        tokens.append(model.logits(hidden, upcast=False).argmax(-1))  # the same argmax, no float32 copy
    return torch.stack(tokens, dim=1)
