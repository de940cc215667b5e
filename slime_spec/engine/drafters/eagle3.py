"""EAGLE3 drafting with a LlamaForCausalLMEagle3 draft head (SGLang's EAGLE3 worker: a chain, or a tree).

The draft head is `Eagle3Draft`, the class the trainer trains (common/eagle3_draft.py: the checkpoint layout and
the step's math), run here against its own KV cache. Draft position p reads (token x_{p+1}, hidden h_p): after each
target forward, a draft extend runs over the newly verified positions with h_p = fc(the target's aux states
at p) (tokens shifted left by one); its last output gives the first draft token and the pre-norm hidden
state that the next draft step reads instead of fc(aux). Draft logits cover the draft vocabulary; draft id d
is target id d + d2t[d] (SGLang's hot_token_id), so a draft token is a target token and q is zero outside it.
The embedding is the target's (SGLang shares it with the draft).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime_spec.common import eagle3_draft
from slime_spec.engine.drafters.base import Drafter, DraftPick, argmax_pick, chain, pad, slots_of, tree_frame
from slime_spec.engine.model_executor.cuda_graph import (
    CudaGraphSettings,
    GraphedForward,
    capture_on_one_pool,
    key_buckets,
)
from slime_spec.engine.model_executor.model import CausalLM, KVCache, attention_backends, causal_mask
from slime_spec.engine.model_executor.transfer import device_tensor
from slime_spec.engine.speculative import tree, tree_graphs


class Eagle3Drafter(Drafter):
    supports_tree = True
    owns_weights = True
    defers_plain_steps = False  # on_verify extends the head from each plain step's aux states, when it runs (base.py)

    def __init__(self, target: CausalLM, draft: eagle3_draft.Eagle3Draft, aux_layer_ids: list[int],
                 num_steps: int, slots: int, max_seq: int):
        self.target, self.draft, self.num_steps, self.slots, self.max_seq = target, draft, num_steps, slots, max_seq
        # the engine sets `num_steps` per step (adaptive, auto); graphs cover every verify up to this one
        self.max_num_steps = num_steps
        self.aux_layer_ids = aux_layer_ids  # the engine's target forward returns these layers' outputs
        weight = target.lm_head.weight
        self.hot_ids = draft.draft_to_target().to(weight.device)  # [Vd] target id of each draft id
        self.next_hidden = torch.zeros(slots, draft.config["hidden_size"], dtype=weight.dtype, device=weight.device)
        self.cache: KVCache | None = None
        # On CUDA: a chain's "step" and "extend" (capture_graphs), or a tree's "tree" and "extend" (tree_graphs).
        self.graphs: dict[str, GraphedForward] = {}
        self.new_cache()

    def new_cache(self) -> None:
        w = self.target.lm_head.weight
        self.cache = KVCache(1, self.slots, self.max_seq, self.draft.kv_heads, self.draft.head_dim, w.dtype, w.device)
        self.graphs = {}  # captured on the old cache's storage; the engine captures again

    def drop_cache(self) -> None:
        self.cache = None
        self.graphs = {}

    def drop_graphs(self) -> None:
        self.graphs = {}

    def capture_graphs(self, settings: CudaGraphSettings, max_running_requests: int,
                       capture: bool | None = None) -> float:
        """On CUDA, the chain's one-token draft steps ("step": the previous output as hidden input) and the extend
        over a verify's 1..k + 1 positions ("extend": the target's aux states as input) as CUDA graphs, as the
        target's forwards are; returns the capture seconds. The prefill extend stays eager. capture=False runs
        the same padded shapes eagerly (to test the dispatch where no GPU is). A tree's graphs: `tree_graphs`."""
        w = self.target.lm_head.weight
        common = dict(batch_sizes=settings.capture_sizes(max_running_requests, speculative=True),
                      scratch_slot=max_running_requests, device=w.device, capture=capture)
        self.graphs = {"step": GraphedForward(self._run, token_counts=[1], extra=self._hidden_input(),
                                              **self._graph_args(common)),
                       "extend": self._extend_graph(list(range(1, self.max_num_steps + 2)), common)}
        return capture_on_one_pool(list(self.graphs.values()), settings.enable_cudagraph_gc)

    def tree_graphs(self, shape: tree.TreeShape, common: dict) -> list[GraphedForward]:
        """A tree's graphs (tree_graphs.capture_tree_graphs captures them): its draft steps over each row's topk
        frontier ("tree") and the extend over an accepted path, padded to steps + 1 positions ("extend")."""
        self.graphs = {"tree": tree_graphs.tree_graph(self._tree_step, nodes=shape.topk, region=shape.draft_region,
                                                      cache=self.cache, common=common, extra=self._hidden_input()),
                       "extend": self._extend_graph([shape.steps + 1], common)}
        return list(self.graphs.values())

    def _hidden_input(self) -> dict:
        """A draft step's hidden-state input (the head's own previous output), as GraphedForward's `extra`."""
        return {"hidden": ((self.draft.config["hidden_size"],), self.target.lm_head.weight.dtype)}

    def _graph_args(self, common: dict) -> dict:
        """The shared GraphedForward arguments, with this head's KV cache and its key buckets."""
        return dict(common, key_counts=key_buckets(self.max_seq), cache=self.cache)

    def _extend_graph(self, token_counts: list[int], common: dict) -> GraphedForward:
        aux_width = len(self.aux_layer_ids) * self.target.args.hidden_size
        return GraphedForward(self._run, token_counts=token_counts, **self._graph_args(common),
                              extra={"hidden": ((aux_width,), self.target.lm_head.weight.dtype)})

    def _run(self, ids, positions, slots, num_keys, hidden):
        return self.step(ids, hidden, positions, slots, num_keys)

    def _tree_step(self, ids, positions, slots, num_keys, base, start, visible, hidden):
        """A draft-tree step as tree_graphs runs it: node locations and mask from the tree's inputs."""
        cache_positions, mask = tree.node_attention(base, start, visible, num_keys)
        return self.step(ids, hidden, positions, slots, num_keys, cache_positions=cache_positions, attn_mask=mask)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                num_keys: int | None) -> torch.Tensor:
        """A chain step's or an extend's pre-norm output [B, T, H]: from a captured graph when one serves the
        shape, else `step` eagerly."""
        graph = self.graphs.get("extend" if hidden.shape[-1] != self.draft.config["hidden_size"] else "step")
        if graph is not None and graph.serves(self.cache, tokens, num_keys):
            return graph(tokens, positions, slots, num_keys, hidden=hidden)
        return self.step(tokens, hidden, positions, slots, num_keys)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             num_keys: int | None = None, cache_positions: torch.Tensor | None = None,
             attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One cached draft step over tokens/positions [B, T]: its pre-norm output [B, T, H] (the draft-vocab
        logits are `logits(out)`, taken only where a step drafts); hidden is aux states [B, T, n * Ht] (through
        fc) or a previous output.
        cache_positions / attn_mask: a draft-tree node's own cache location and mask (model.eager_forward)."""
        d = self.draft
        if hidden.shape[-1] != d.config["hidden_size"]:
            hidden = d.project(hidden)
        q, k, v = d.qkv(self.target.model.embed_tokens(tokens), hidden, positions)  # [B, heads, T, D]
        write = positions if cache_positions is None else cache_positions
        self.cache.k[0][slots[:, None], write] = k.transpose(1, 2)
        self.cache.v[0][slots[:, None], write] = v.transpose(1, 2)
        S = attn_mask.shape[-1] if attn_mask is not None else num_keys or int(positions.max()) + 1
        keys = self.cache.k[0][slots, :S].transpose(1, 2)
        values = self.cache.v[0][slots, :S].transpose(1, 2)
        mask = attn_mask if attn_mask is not None else causal_mask(positions, S)
        with attention_backends(q.device):  # eager on CUDA: no cuDNN plan per shape
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=d.heads != d.kv_heads)
        return d.finish(hidden, attn)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., Vd] float32 of a step's output."""
        return self.draft.logits(out).float()

    def target_vocab_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[B, Vd] -> [B, V]: -inf outside the draft vocabulary, so picks and q are over target ids."""
        full = draft_logits.new_full((draft_logits.shape[0], self.target.args.vocab_size), float("-inf"))
        return full.index_copy_(1, self.hot_ids, draft_logits)

    def _extend(self, rows, tokens, aux, positions, last, num_keys=None) -> None:
        slots = slots_of(rows, tokens.device)
        out = self.forward(tokens, aux, positions, slots, num_keys)
        self.next_hidden[slots] = out[torch.arange(len(rows), device=out.device), last]

    def on_prefill(self, rows, aux: torch.Tensor) -> None:
        device = aux.device
        tokens = pad([r.tokens[1:] for r in rows], device)
        positions = torch.arange(tokens.shape[1], device=device)[None].expand_as(tokens)
        last = device_tensor([len(r.tokens) - 2 for r in rows], device)
        self._extend(rows, tokens, aux[:, : tokens.shape[1]], positions, last)

    def propose(self, rows) -> torch.Tensor:
        return self.sample_draft(rows, argmax_pick)[0]

    def sample_draft(self, rows, pick: DraftPick) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = self.next_hidden.device
        slots = slots_of(rows, device)
        pos = device_tensor([r.kv_len for r in rows], device)
        max_kv = max(r.kv_len for r in rows)
        hidden = self.next_hidden[slots]

        def step(j: int, token: torch.Tensor | None) -> torch.Tensor:
            nonlocal hidden
            if j == 0:
                return self.target_vocab_logits(self.logits(hidden))
            hidden = self.forward(token[:, None], hidden[:, None], (pos + j - 1)[:, None], slots, max_kv + j)[:, 0]
            return self.target_vocab_logits(self.logits(hidden))

        return chain(self.num_steps, step, pick)

    def tree_draft(self, rows, shape: tree.TreeShape) -> tree.DraftTree:
        """A draft tree per row (eagle_topk > 1), laid out as MTPDrafter.tree_draft lays out its own."""
        device = self.next_hidden.device
        slots, pos, num_keys = tree_frame(rows, shape.draft_region, device)
        first = self.next_hidden[slots]

        def step(i: int, tokens: torch.Tensor, hidden: torch.Tensor, visible: torch.Tensor):
            b, k = tokens.shape
            out = tree_graphs.run_tree(self.graphs.get("tree"), self._tree_step, self.cache, tokens,
                                       (pos + i)[:, None].expand(-1, k), slots, num_keys, base=pos, start=pos + i * k,
                                       visible=visible, hidden=hidden)
            return self.target_vocab_logits(self.logits(out).flatten(0, 1)).view(b, k, -1), out

        root = device_tensor([r.tokens[-1] for r in rows], device)
        return tree.draft_tree(root, self.target_vocab_logits(self.logits(first)), first, step, shape)

    def on_verify(self, rows, aux: torch.Tensor, accepted: list[int]) -> None:
        device = aux.device
        k1 = aux.shape[1]
        tokens = pad([r.tokens[len(r.tokens) - a - 1:] for r, a in zip(rows, accepted)], device)
        tokens = F.pad(tokens, (0, k1 - tokens.shape[1]))
        start = device_tensor([r.kv_len - a - 1 for r, a in zip(rows, accepted)], device)
        positions = start[:, None] + torch.arange(k1, device=device)[None]
        num_keys = max(r.kv_len - a - 1 for r, a in zip(rows, accepted)) + k1
        self._extend(rows, tokens, aux, positions, device_tensor(accepted, device), num_keys)

    def weight_runner(self) -> dict[str, torch.nn.Parameter]:
        """The draft's own parameters by checkpoint name (what selector `draft` updates); the embedding is
        the target's and d2t / t2d never change."""
        return dict(self.draft.named_parameters())


def load_eagle3_drafter(target: CausalLM, path: str, num_steps: int, slots: int, max_seq: int) -> Eagle3Drafter:
    """The draft at `path` (SGLang's EAGLE3 layout) on the target's device, parameters in the target's dtype."""
    weight = target.lm_head.weight
    draft = eagle3_draft.load_draft(path, target.args.num_layers).to(weight.device)
    if draft.config.get("target_hidden_size", target.args.hidden_size) != target.args.hidden_size or \
            draft.config["hidden_size"] != target.args.hidden_size:
        raise ValueError(f"--speculative-draft-model-path {path}: hidden_size {draft.config['hidden_size']} is not "
                         f"the target's {target.args.hidden_size}; the EAGLE3 draft shares the target's embedding")
    if draft.config["vocab_size"] != target.args.vocab_size:
        raise ValueError(f"--speculative-draft-model-path {path}: vocab_size {draft.config['vocab_size']} != the "
                         f"target's {target.args.vocab_size}; EAGLE3 needs a draft made for this target")
    with torch.no_grad():
        for p in draft.parameters():
            p.data = p.data.to(weight.dtype)
    draft.eval().requires_grad_(False)
    ids = eagle3_draft.aux_layer_ids(draft.config, target.args.num_layers)
    return Eagle3Drafter(target, draft, ids, num_steps, slots, max_seq)
