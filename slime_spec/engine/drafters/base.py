"""The drafter protocol and the helpers every drafter shares.

A drafter proposes k tokens per running row; the engine verifies them with one batched target forward.

Every drafter here drafts greedily (SGLang's eagle_topk 1 chain picks the draft's argmax; NGRAM copies tokens),
so the draft distribution q is one-hot and verification (see sampling.speculative_accept) is lossless.

Row state the engine keeps (see core._Row): `tokens` (prompt + output), `kv_len` (tokens whose keys/values are
in the target cache: all but the last, pending one), `slot` (cache row). The settings come from
`slime_spec.spec.SpecConfig`, resolved and checked for this engine before `make_drafter` runs.

Drafter protocol:
  k                                   draft tokens per verify (SpecConfig.draft_tokens_per_verify)
  on_prefill(rows, hidden)            after the target prefilled rows and appended their first token
  propose(rows) -> LongTensor [B, k]  draft tokens following each row's pending token
  on_verify(rows, hidden, accepted)   after the verify pass appended accepted[i] + 1 tokens to rows[i]
  weight_runner() -> {hf name: param} the draft's weights, as SGLang's draft runner loads them (or None)
  new_cache() / drop_cache()          (re)allocate or free the drafter's KV cache
"""

from __future__ import annotations

from typing import Protocol

import torch


class Drafter(Protocol):
    """What EngineCore calls on a drafter (see the module docstring for when)."""

    k: int

    def on_prefill(self, rows, hidden: torch.Tensor) -> None: ...

    def propose(self, rows) -> torch.Tensor: ...

    def on_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None: ...

    def weight_runner(self) -> dict[str, torch.nn.Parameter] | None: ...

    def new_cache(self) -> None: ...

    def drop_cache(self) -> None: ...


def pad(seqs: list[list[int]], device) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.long, device=device)


def slots_of(rows, device) -> torch.Tensor:
    return torch.tensor([r.slot for r in rows], dtype=torch.long, device=device)
