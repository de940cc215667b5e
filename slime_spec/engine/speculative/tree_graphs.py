"""CUDA graphs for tree speculation (eagle_topk > 1): the target's tree verify and the drafters' tree steps.

A tree forward runs T nodes per row, node t at its own cache location start + t and its own RoPE position,
attending to the row's context (keys below base) and to the region locations base + r that its row of
`visible` marks (engine/speculative/tree.py). The verify's T is num_draft_tokens, its region the tree itself (start =
base,
visible the ancestor mask); a draft step's T is topk, its region the frontier locations of the whole draft
(start = base + step * topk). The cache locations and the mask are computed inside the graph from static-shape
inputs (`tree.node_attention`): base and start per row, the position and the `visible` row per node. So, as
for chains (engine/model_executor/cuda_graph.py), one graph per (batch size, key bucket) serves every tree; SGLang's
target-verify
and draft graph runners take a tree as inputs the same way (positions, out_cache_loc, custom_mask).

Padded rows write only into the scratch slot; their `visible` rows start all True (SGLang's custom_mask
buffer starts as ones) and later hold a real row's, so no padded query is left without a key to attend to.
"""

from __future__ import annotations

from typing import Callable

import torch

from slime_spec.engine.model_executor.cuda_graph import GraphedForward, InputSpecs, capture_on_one_pool, key_buckets
from slime_spec.engine.model_executor.model import CausalLM, KVCache
from slime_spec.engine.speculative import tree

ROW_INPUTS: InputSpecs = {"base": ((), torch.long), "start": ((), torch.long)}  # per row: context length, node 0


def tree_forward_fn(model: CausalLM, cache: KVCache, aux_layer_ids: list[int] | None = None,
                    graphed: bool = False) -> Callable[..., torch.Tensor]:
    """A CausalLM's tree forward (the target's verify, a STANDALONE draft's tree step) as GraphedForward calls it:
    final hidden states [B, T, H], the aux layers' outputs concatenated after them for EAGLE3 (as "target_aux")."""
    def forward(ids, positions, slots, num_keys, base, start, visible):
        cache_positions, mask = tree.node_attention(base, start, visible, num_keys)
        out = model.eager_forward(ids, positions, cache, slots, num_keys, aux_layer_ids=aux_layer_ids,
                                  cache_positions=cache_positions, attn_mask=mask, graphed=graphed)
        return torch.cat(out, dim=-1) if aux_layer_ids else out

    return forward


def mtp_tree_fn(model: CausalLM, cache: KVCache, graphed: bool = False) -> Callable[..., torch.Tensor]:
    """The MTP layer's tree draft step as GraphedForward calls it: its output [B, T, H] (model.eager_mtp_forward)."""
    def forward(ids, positions, slots, num_keys, base, start, visible, prev_hidden):
        cache_positions, mask = tree.node_attention(base, start, visible, num_keys)
        return model.eager_mtp_forward(ids, prev_hidden, positions, cache, slots, num_keys=num_keys,
                                       cache_positions=cache_positions, attn_mask=mask, graphed=graphed)

    return forward


def tree_graph(fn: Callable[..., torch.Tensor], *, nodes: int, region: int, cache: KVCache, common: dict,
               extra: InputSpecs | None = None) -> GraphedForward:
    """A GraphedForward of `nodes` tokens per row over `cache` taking a tree's inputs (base, start, visible over
    `region` locations) and `extra`; common: batch_sizes, scratch_slot, device, capture (`tree_graph_common`)."""
    graph = GraphedForward(fn, token_counts=[nodes], key_counts=key_buckets(cache.max_seq), cache=cache,
                           extra={"visible": ((region,), torch.bool), **(extra or {})}, row_extra=ROW_INPUTS,
                           **common)
    graph.extra["visible"].fill_(True)
    return graph


def run_tree(graph: GraphedForward | None, fn: Callable[..., torch.Tensor], cache: KVCache, ids: torch.Tensor,
             positions: torch.Tensor, slots: torch.Tensor, num_keys: int, **inputs: torch.Tensor) -> torch.Tensor:
    """`graph` when it serves the call (its cache, a captured shape), else `fn` eagerly: the same math either way."""
    if graph is not None and graph.serves(cache, ids, num_keys):
        return graph(ids, positions, slots, num_keys, **inputs)
    return fn(ids, positions, slots, num_keys, **inputs)


def verify_tree(model: CausalLM, cache: KVCache, drafted: tree.DraftTree, base: torch.Tensor, slots: torch.Tensor,
                num_keys: int, aux_layer_ids: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over every node of the rows' trees (node j at base + j, RoPE position base + depth): (final
    hidden [B, N, H], what the drafter reads: the aux states for EAGLE3, else the final hidden again)."""
    out = run_tree(model.graphs.get("tree"), tree_forward_fn(model, cache, aux_layer_ids), cache, drafted.tokens,
                   base[:, None] + drafted.depth, slots, num_keys, base=base, start=base, visible=drafted.mask)
    if not aux_layer_ids:
        return out, out
    return out[..., : model.args.hidden_size], out[..., model.args.hidden_size:]


def tree_graph_common(engine, capture: bool | None = None) -> dict:
    """The GraphedForward arguments every graph of a tree engine shares."""
    return dict(batch_sizes=engine.cuda_graph.capture_sizes(engine.max_running_requests, speculative=True),
                scratch_slot=engine.max_running_requests, device=engine.model.lm_head.weight.device, capture=capture)


def capture_tree_graphs(engine, shape: tree.TreeShape, capture: bool | None = None) -> float:
    """A tree engine's graphs: the target's verify ("tree" in engine.model.graphs, aux states included for
    EAGLE3), and the drafter's tree steps and the extend it runs after each verify (its `tree_graphs`), all on one
    memory pool; returns the capture seconds. capture=False runs the same padded shapes eagerly (CPU tests).
    The target's decode graph is not captured: a tree engine takes no plain steps and prefills eagerly."""
    common = tree_graph_common(engine, capture)
    aux = engine.drafter.aux_layer_ids
    verify = tree_graph(tree_forward_fn(engine.model, engine.cache, aux, graphed=True), nodes=shape.num_draft_tokens,
                        region=shape.num_draft_tokens, cache=engine.cache, common=common)
    engine.model.graphs = {"tree": verify}
    graphs = [verify] + engine.drafter.tree_graphs(shape, common)
    return capture_on_one_pool(graphs, engine.cuda_graph.enable_cudagraph_gc)
