"""NGRAM drafting: copy what followed the row's current suffix earlier in its own tokens."""

from __future__ import annotations

import torch


class NgramDrafter:
    """NGRAM: copy the continuation of the longest earlier match of the row's suffix in its own prompt + output.

    SGLang keeps a trie over recent requests; this is a per-request suffix index (n-gram -> the position right
    after its latest occurrence), updated incrementally. Rows with no match get filler drafts, which verification
    rejects at no cost to correctness.
    """

    def __init__(self, k: int, max_window: int, min_window: int, device):
        self.k, self.max_window, self.min_window, self.device = k, max_window, min_window, device

    def new_cache(self) -> None:
        return None

    def drop_cache(self) -> None:
        return None

    def _index(self, r) -> None:
        tokens = r.tokens
        # An n-gram ending right before position e is indexed once tokens[e] (its continuation) exists.
        for e in range(r.ngram_upto, len(tokens)):
            for w in range(1, min(self.max_window, e) + 1):
                r.ngram_index[tuple(tokens[e - w:e])] = e
        r.ngram_upto = len(tokens)

    def draft_for(self, r) -> list[int]:
        self._index(r)
        tokens = r.tokens
        for w in range(min(self.max_window, len(tokens)), self.min_window - 1, -1):
            e = r.ngram_index.get(tuple(tokens[-w:]))
            if e is not None:
                found = tokens[e:e + self.k]
                return found + [found[-1]] * (self.k - len(found))
        return [tokens[-1]] * self.k

    def on_prefill(self, rows, hidden: torch.Tensor) -> None:
        for r in rows:
            self._index(r)

    def propose(self, rows) -> torch.Tensor:
        return torch.tensor([self.draft_for(r) for r in rows], dtype=torch.long, device=self.device)

    def on_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None:
        return None

    def weight_runner(self) -> None:
        return None
