"""STANDALONE drafting: a separate small causal LM (SGLang's --speculative-draft-model-path), chain or tree."""

from __future__ import annotations

import torch

from slime_spec.engine.drafters.base import Drafter, DraftPick, argmax_pick, chain, pad, slots_of
from slime_spec.engine.model_executor.cuda_graph import GraphedForward, key_buckets
from slime_spec.engine.model_executor.model import CausalLM, KVCache, hf_weight_names
from slime_spec.engine.model_executor.transfer import device_tensor
from slime_spec.engine.speculative import tree, tree_graphs

VERIFY_UNSEEN = 2  # tokens a chain verify leaves the draft to feed: the new pending one, and d_k if all k passed


class StandaloneDrafter(Drafter):
    """STANDALONE: a separate small causal LM with its own KV cache, drafting greedily k tokens per verify.

    `r.draft_cached_len` counts the tokens of row r whose keys/values the draft cache holds; after a verify only the
    accepted prefix of what the draft consumed stays, and the next propose first catches up on the rest (one or
    two tokens, in its first draft step). Plain steps (k = 0) leave more behind: the engine feeds that backlog
    through `catch_up_deferred` before drafting, so it is timed as the switch from k = 0, not as drafting.
    """

    supports_tree = True
    owns_weights = True
    defers_plain_steps = True  # a plain step only adds tokens, fed at the next catch-up (base.py)

    def __init__(self, draft: CausalLM, num_steps: int, slots: int, max_seq: int):
        self.draft, self.num_steps, self.slots, self.max_seq = draft, num_steps, slots, max_seq
        self.cache: KVCache | None = None
        self.new_cache()

    def new_cache(self) -> None:
        self.cache = self.draft.new_cache(self.slots, self.max_seq)

    def drop_cache(self) -> None:
        self.cache = None

    def _forward(self, rows, seqs: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Run the draft over seqs[i] at positions starts[i]... (into its cache); its hidden states [B, T, H]."""
        device = self.draft.lm_head.weight.device
        tokens = pad(seqs, device)
        positions = device_tensor(starts, device)[:, None] + torch.arange(tokens.shape[1], device=device)
        num_keys = max(start + len(s) for start, s in zip(starts, seqs))  # from the host: no read-back
        return self.draft(tokens, positions, self.cache, slots_of(rows, device), num_keys)

    def _feed(self, rows, seqs: list[list[int]], starts: list[int]) -> torch.Tensor:
        """_forward, and the logits at each row's last token."""
        hidden = self._forward(rows, seqs, starts)
        last = device_tensor([len(s) - 1 for s in seqs], hidden.device)
        return self.draft.logits(hidden[torch.arange(len(rows), device=hidden.device), last])

    def on_prefill(self, rows, hidden: torch.Tensor) -> None:
        self._forward(rows, [r.tokens[:-1] for r in rows], [0] * len(rows))
        for r in rows:
            r.draft_cached_len = len(r.tokens) - 1

    def catch_up_deferred(self, rows) -> bool:
        """Feed the tokens plain steps committed since the last draft, in one batched call: every unseen token but
        the pending one, for the rows more than VERIFY_UNSEEN behind, so that the first draft step feeds what it
        feeds after a verify. A row one plain step behind a verify that rejected a draft (two unseen) is left to
        the first draft step, which then feeds two tokens, as after a verify that accepted every draft. Returns
        whether any row was fed."""
        behind = [r for r in rows if len(r.tokens) - r.draft_cached_len > VERIFY_UNSEEN]
        if not behind:
            return False
        self._forward(behind, [r.tokens[r.draft_cached_len:-1] for r in behind], [r.draft_cached_len for r in behind])
        for r in behind:
            r.draft_cached_len = len(r.tokens) - 1
        return True

    def propose(self, rows) -> torch.Tensor:
        return self.sample_draft(rows, argmax_pick)[0]

    def sample_draft(self, rows, pick: DraftPick) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Catch the draft cache up on each row's unseen tokens, then k batched one-token draft steps."""
        device = self.draft.lm_head.weight.device
        slots = slots_of(rows, device)
        pos = device_tensor([len(r.tokens) for r in rows], device)
        longest = max(len(r.tokens) for r in rows)

        def step(j: int, token: torch.Tensor | None) -> torch.Tensor:
            if j == 0:
                return self._feed(rows, [r.tokens[r.draft_cached_len:] for r in rows],
                                  [r.draft_cached_len for r in rows])
            hidden = self.draft(token[:, None], (pos + j - 1)[:, None], self.cache, slots, longest + j)  # graphed
            return self.draft.logits(hidden[:, 0])

        return chain(self.num_steps, step, pick)

    def tree_draft(self, rows, shape: tree.TreeShape) -> tree.DraftTree:
        """A draft tree per row (eagle_topk > 1): catch up (the pending token included), then each step runs the
        draft once over every row's top-k frontier, node j of step i at cache location len(tokens) + i * topk + j
        and RoPE position len(tokens) + i, seeing the context and its ancestors."""
        device = self.draft.lm_head.weight.device
        slots = slots_of(rows, device)
        first = self._feed(rows, [r.tokens[r.draft_cached_len:] for r in rows], [r.draft_cached_len for r in rows])
        for r in rows:
            r.draft_cached_len = len(r.tokens)
        base = device_tensor([len(r.tokens) for r in rows], device)
        num_keys = max(len(r.tokens) for r in rows) + shape.draft_region
        graph, eager = self.draft.graphs.get("tree"), tree_graphs.tree_forward_fn(self.draft, self.cache)

        def step(i: int, tokens: torch.Tensor, _state: torch.Tensor, visible: torch.Tensor):
            k = tokens.shape[1]
            hidden = tree_graphs.run_tree(graph, eager, self.cache, tokens, (base + i)[:, None].expand(-1, k), slots,
                                          num_keys, base=base, start=base + i * k, visible=visible)
            return self.draft.logits(hidden), _state

        root = device_tensor([r.tokens[-1] for r in rows], device)
        no_state = torch.zeros(len(rows), 1, device=device)  # the draft reads tokens only
        return tree.draft_tree(root, first, no_state, step, shape)

    def tree_graphs(self, shape: tree.TreeShape, common: dict) -> list[GraphedForward]:
        """A tree's graphs of the draft model (tree_graphs.capture_tree_graphs captures them): its draft steps over
        each row's topk frontier ("tree") and its catch-up on the 1..steps + 1 tokens a tree verify commits
        ("target", which the draft's forward replays)."""
        draft, cache = self.draft, self.cache

        def catch_up(ids, positions, slots, num_keys):
            return draft.eager_forward(ids, positions, cache, slots, num_keys, graphed=True)

        draft.graphs = {"target": GraphedForward(catch_up, token_counts=list(range(1, shape.steps + 2)),
                                                 key_counts=key_buckets(cache.max_seq), cache=cache, **common),
                        "tree": tree_graphs.tree_graph(tree_graphs.tree_forward_fn(draft, cache, graphed=True),
                                                       nodes=shape.topk, region=shape.draft_region, cache=cache,
                                                       common=common)}
        return list(draft.graphs.values())

    def on_tree_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None:
        """After a tree verify the draft cache keeps the context and the old pending token; the accepted tokens
        are fed at the next draft's catch-up."""
        for r, a in zip(rows, accepted):
            r.draft_cached_len = r.kv_len - a

    def on_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None:
        if self.num_steps == 0:
            return  # no draft step ran: the draft cache catches up at the next propose
        for r, a in zip(rows, accepted):
            # The draft consumed the old pending token and d_1..d_{k-1}; valid are the pending token and d_1..d_a.
            r.draft_cached_len = r.kv_len - a + min(a, self.num_steps - 1)

    def weight_runner(self) -> dict[str, torch.nn.Parameter]:
        params = dict(self.draft.named_parameters(remove_duplicate=False))
        return {n: params[n] for n in hf_weight_names(self.draft)}
