"""NGRAM drafting: copy what followed the row's current suffix in any request's tokens (a cache shared by all)."""

from __future__ import annotations

import itertools

import torch

from slime_spec.engine.drafters.base import Drafter
from slime_spec.engine.model_executor.transfer import device_tensor

DEFAULT_CAPACITY = 262_144  # n-gram entries; past it the oldest quarter goes (SGLang: --speculative-ngram-capacity)
MOD = (1 << 61) - 1  # rolling-hash modulus (a Mersenne prime: collisions are ~1 in 2**61 per pair)
BASE = 1_000_003


class PrefixHashes:
    """Polynomial prefix hashes of one row's tokens, extended only by the tokens appended since the last call.

    The hash of tokens[i:j] is one subtraction and one multiplication, so an n-gram key costs O(1) instead of
    building a tuple of n tokens. A collision only makes a draft wrong, which verification rejects."""

    powers = [1]  # BASE**i mod MOD, shared by every row

    def __init__(self):
        self.prefix = [0]

    def extend(self, tokens: list[int]) -> None:
        prefix = self.prefix
        h = prefix[-1]
        for t in tokens[len(prefix) - 1:]:
            h = (h * BASE + t + 1) % MOD
            prefix.append(h)
        powers = PrefixHashes.powers
        while len(powers) < len(prefix):
            powers.append(powers[-1] * BASE % MOD)

    def key(self, start: int, end: int) -> int:
        """One int per (n, hash of tokens[start:end]) with n = end - start: n-grams of two lengths never meet."""
        return (self.prefix[end] - self.prefix[start] * PrefixHashes.powers[end - start]) % MOD + (end - start) * MOD


class NgramDrafter(Drafter):
    """NGRAM: copy the continuation of the latest earlier occurrence of the row's longest suffix (up to
    max_window tokens) in the n-gram cache.

    Like SGLang 0.5.23's trie (one per server, fed with every request's tokens after each verify), the cache is
    shared across requests: a row drafts from its own prompt + output and from every other request's, running
    or finished, so the samples of a GRPO group draft from each other. Entries map an n-gram (a rolling hash)
    to (the token list it came from, the position right after it); rows with no match get filler drafts,
    which verification rejects at no cost to correctness.

    Cost per row and step: max_window dictionary writes per new token (each n-gram ending there) and a binary
    search over suffix lengths (log2 max_window lookups): every suffix of an indexed n-gram is indexed too.
    """

    defers_plain_steps = False  # NGRAM does not run under the overlap schedule (base.py; docs/en/speculative.md)

    def __init__(self, num_steps: int, max_window: int, min_window: int, device, capacity: int = DEFAULT_CAPACITY):
        self.num_steps, self.max_window, self.min_window, self.device = num_steps, max_window, min_window, device
        self.capacity = capacity
        self.index: dict[int, tuple[list[int], int]] = {}

    def drop_cache(self) -> None:
        """Released with the KV cache (and flushed with it, as SGLang's flush_cache resets its trie)."""
        self.index.clear()

    def _hashes(self, r) -> PrefixHashes:
        h = r.draft_state.get("ngram")
        if h is None:
            h = r.draft_state["ngram"] = PrefixHashes()
        h.extend(r.tokens)
        return h

    def _index(self, r) -> PrefixHashes:
        tokens, h = r.tokens, self._hashes(r)
        prefix, powers, index, window = h.prefix, PrefixHashes.powers, self.index, self.max_window
        # An n-gram ending right before position e is indexed once tokens[e] (its continuation) exists; keys as
        # PrefixHashes.key computes them, inlined (this loop is the drafter's hot path).
        for e in range(r.ngram_upto, len(tokens)):
            pe = prefix[e]
            keys = [(pe - prefix[e - w] * powers[w]) % MOD + w * MOD for w in range(1, min(window, e) + 1)]
            index.update(dict.fromkeys(keys, (tokens, e)))
        r.ngram_upto = len(tokens)
        if len(index) > self.capacity:  # evict in bulk, oldest first (a key keeps the place of its first insert)
            for key in list(itertools.islice(index, len(index) - self.capacity * 3 // 4)):
                del index[key]
        return h

    def match(self, r) -> tuple[int, list[int]]:
        """(matched suffix length, up to k continuation tokens); (0, []) without a match."""
        h = self._index(r)
        n = len(r.tokens)
        lo, hi, best = self.min_window, min(self.max_window, n), None
        while lo <= hi:  # the longest indexed suffix: if n tokens match, so do their last n - 1
            w = (lo + hi) // 2
            hit = self.index.get(h.key(n - w, n))
            if hit is not None:
                best, lo = (w, hit), w + 1
            else:
                hi = w - 1
        if best is None:
            return 0, []
        w, (source, e) = best
        return w, source[e:e + self.num_steps]

    def draft_for(self, r) -> list[int]:
        _, found = self.match(r)
        if not found:
            return [r.tokens[-1]] * self.num_steps
        return found + [found[-1]] * (self.num_steps - len(found))

    def on_prefill(self, rows, hidden: torch.Tensor) -> None:
        for r in rows:
            self._index(r)

    def propose(self, rows) -> torch.Tensor:
        for r in rows:  # every row's tokens are in the shared cache before any row drafts
            self._index(r)
        return device_tensor([self.draft_for(r) for r in rows], self.device, torch.long)
