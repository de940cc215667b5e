"""The drafter protocol and the helpers every drafter shares.

A drafter proposes k tokens per running row; the engine verifies them with one batched target forward.

By default every drafter drafts greedily (SGLang's eagle_topk 1 chain picks the draft's argmax; NGRAM copies
tokens), so the draft distribution q is one-hot and verification (see sampling.speculative_accept) is lossless.
Chain drafters with a distribution (MTP, STANDALONE) also implement the optional `sample_draft(rows, pick)`: the
engine's `pick` turns each step's draft logits into tokens and, when drafting by sampling, the distribution q each
token was sampled from; verification then uses q (accept with min(1, p/q), resample from max(0, p - q)).

Row state the engine keeps (see request.Row): `tokens` (prompt + output), `kv_len` (tokens whose keys/values are
in the target cache: all but the last, pending one), `slot` (cache row). The settings come from
`slime_spec.spec.SpecConfig`, resolved and checked for this engine before `make_drafter` runs.

Drafter protocol:
  k                                   draft tokens of the next verify; the engine may set it per step (adaptive
                                      and auto speculation, 0 = a plain step) at most to the k it was built with
                                      (SpecConfig.draft_tokens_per_verify); read it in propose and on_verify
  on_prefill(rows, hidden)            after the target prefilled rows and appended their first token
  propose(rows) -> LongTensor [B, k]  draft tokens following each row's pending token
  on_verify(rows, hidden, accepted)   after the verify pass appended accepted[i] + 1 tokens to rows[i]
  weight_runner() -> {hf name: param} the draft's weights, as SGLang's draft runner loads them (or None)
  new_cache() / drop_cache()          (re)allocate or free the drafter's KV cache
  defers_plain_steps                  whether a plain step (k = 0) needs nothing from the drafter until the step is
                                      read back, a step late: then the overlap schedule (engine/overlap.py) may run
                                      a chain's plain steps, handing each read-back step to the optional
                                      `defer(rows, hidden, positions)`; the engine then calls the optional
                                      `catch_up_deferred(rows) -> bool` (whether it ran anything) before the next
                                      chain draft, timed as the switch back from k = 0 (see speculative.catch_up)
Optional:
  sample_draft(rows, pick) -> (LongTensor [B, k], q [B, k, V] or None)   see above
  tree_draft(rows, shape) -> tree.DraftTree   eagle_topk > 1 (MTP, EAGLE3, STANDALONE): a draft tree per row
                                              (engine/tree.py); on_verify then gets the accepted path's states
  on_tree_verify(rows, hidden, accepted)      after a tree verify, where on_verify's chain bookkeeping differs
  tree_graphs(shape, common) -> [GraphedForward]   on CUDA, the tree draft steps and extend as graphs, installed
                                              where the drafter replays them (engine/tree_graphs.py)
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from slime_spec.engine.transfer import device_tensor


class Drafter(Protocol):
    """What EngineCore calls on a drafter (see the module docstring for when)."""

    k: int
    defers_plain_steps: bool

    def on_prefill(self, rows, hidden: torch.Tensor) -> None: ...

    def propose(self, rows) -> torch.Tensor: ...

    def on_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None: ...

    def weight_runner(self) -> dict[str, torch.nn.Parameter] | None: ...

    def new_cache(self) -> None: ...

    def drop_cache(self) -> None: ...


# logits [B, V] of one draft step -> (tokens [B], the distribution they were drawn from [B, V], or None if greedy)
DraftPick = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def argmax_pick(logits: torch.Tensor) -> tuple[torch.Tensor, None]:
    return logits.argmax(-1), None


def chain(k: int, step: Callable[[int, torch.Tensor | None], torch.Tensor],
          pick: DraftPick) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run k draft steps (`step(j, previous token)` -> logits [B, V]) and stack the picked tokens and their q."""
    tokens, probs, token = [], [], None
    for j in range(k):
        token, q = pick(step(j, token))
        tokens.append(token)
        probs.append(q)
    if not tokens:
        raise ValueError("a draft chain needs k >= 1; the engine runs k = 0 as a plain step without drafting")
    return torch.stack(tokens, dim=1), (None if probs[0] is None else torch.stack(probs, dim=1))


def pad(seqs: list[list[int]], device) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return device_tensor([s + [0] * (width - len(s)) for s in seqs], device, torch.long)


def slots_of(rows, device) -> torch.Tensor:
    return device_tensor([r.slot for r in rows], device, torch.long)


def tree_frame(rows, draft_region: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(slots [B], context lengths [B], keys to read) of a draft tree over `rows` whose frontier nodes take
    `draft_region` cache locations past each row's context (tree.TreeShape.draft_region)."""
    pos = device_tensor([r.kv_len for r in rows], device)
    return slots_of(rows, device), pos, max(r.kv_len for r in rows) + draft_region
