"""NGRAM drafting: copy what followed the row's current suffix in any request's tokens (a cache shared by all)."""

from __future__ import annotations

from collections import OrderedDict

import torch

DEFAULT_CAPACITY = 262_144  # n-gram entries; the oldest go first (SGLang: --speculative-ngram-capacity nodes)


class NgramDrafter:
    """NGRAM: copy the continuation of the latest earlier occurrence of the row's longest suffix (up to
    max_window tokens) in the n-gram cache.

    Like SGLang 0.5.23's trie (one per server, fed with every request's tokens after each verify), the cache is
    shared across requests: a row drafts from its own prompt + output and from every other request's, running
    or finished, so the samples of a GRPO group draft from each other. Entries map an n-gram to (the token list
    it came from, the position right after it); rows with no match get filler drafts, which verification
    rejects at no cost to correctness.
    """

    def __init__(self, k: int, max_window: int, min_window: int, device, capacity: int = DEFAULT_CAPACITY):
        self.k, self.max_window, self.min_window, self.device = k, max_window, min_window, device
        self.capacity = capacity
        self.index: OrderedDict[tuple, tuple[list[int], int]] = OrderedDict()

    def new_cache(self) -> None:
        return None

    def drop_cache(self) -> None:
        """Released with the KV cache (and flushed with it, as SGLang's flush_cache resets its trie)."""
        self.index.clear()

    def _index(self, r) -> None:
        tokens = r.tokens
        # An n-gram ending right before position e is indexed once tokens[e] (its continuation) exists.
        for e in range(r.ngram_upto, len(tokens)):
            for w in range(1, min(self.max_window, e) + 1):
                key = tuple(tokens[e - w:e])
                self.index[key] = (tokens, e)
                self.index.move_to_end(key)
        r.ngram_upto = len(tokens)
        while len(self.index) > self.capacity:
            self.index.popitem(last=False)

    def match(self, r) -> tuple[int, list[int]]:
        """(matched suffix length, up to k continuation tokens); (0, []) without a match."""
        self._index(r)
        tokens = r.tokens
        for w in range(min(self.max_window, len(tokens)), self.min_window - 1, -1):
            hit = self.index.get(tuple(tokens[-w:]))
            if hit is not None:
                source, e = hit
                found = source[e:e + self.k]
                if found:
                    return w, found
        return 0, []

    def draft_for(self, r) -> list[int]:
        _, found = self.match(r)
        if not found:
            return [r.tokens[-1]] * self.k
        return found + [found[-1]] * (self.k - len(found))

    def on_prefill(self, rows, hidden: torch.Tensor) -> None:
        for r in rows:
            self._index(r)

    def propose(self, rows) -> torch.Tensor:
        for r in rows:  # every row's tokens are in the shared cache before any row drafts
            self._index(r)
        return torch.tensor([self.draft_for(r) for r in rows], dtype=torch.long, device=self.device)

    def on_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None:
        return None

    def weight_runner(self) -> None:
        return None
