"""Rollout history: per prompt, the responses drafting can copy from (issue #16).

In RL the same prompt is sampled n times per step and again every epoch, so earlier answers to it share long
spans with the next ones. The store keeps, per prompt key, the responses of the prompt's last K rollouts
(epochs) plus those of its current group as they finish, bounded in tokens and evicted oldest first.

Pure bookkeeping (no engine, no I/O): the rollout manager feeds it finished samples and mirrors what it holds
into the engines' drafting corpora (see `corpus_documents` / `sync_plan`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


def prompt_key(prompt_ids: list[int]) -> str:
    """A stable key for a prompt: the same token ids give the same key in every epoch and process."""
    digest = hashlib.blake2b(",".join(map(str, prompt_ids)).encode(), digest_size=8)
    return digest.hexdigest()


@dataclass(frozen=True)
class Entry:
    rollout_id: int
    tokens: tuple[int, ...]
    text: str = ""


@dataclass
class PromptHistory:
    entries: list[Entry] = field(default_factory=list)  # oldest first

    @property
    def num_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries)


class HistoryStore:
    """Per prompt key: responses of the last `epochs` rollouts of that prompt and of the current one.

    `max_tokens` bounds each prompt's history; the oldest responses go first. A response longer than the bound
    keeps only its last `max_tokens` tokens (its text is dropped: the tokens no longer match it).
    """

    def __init__(self, epochs: int, max_tokens: int):
        if epochs < 0:
            raise ValueError(f"--rollout-history-epochs {epochs}: must be >= 0 (0 keeps only the current group)")
        if max_tokens < 1:
            raise ValueError(f"--rollout-history-max-tokens {max_tokens}: must be >= 1")
        self.epochs, self.max_tokens = epochs, max_tokens
        self._prompts: dict[str, PromptHistory] = {}
        self._changed: set[str] = set()

    def add(self, key: str, rollout_id: int, tokens: list[int], text: str = "") -> None:
        """Record one finished response to prompt `key` generated in rollout `rollout_id`."""
        if not tokens:
            return
        if len(tokens) > self.max_tokens:
            tokens, text = tokens[-self.max_tokens:], ""
        hist = self._prompts.setdefault(key, PromptHistory())
        hist.entries.append(Entry(rollout_id, tuple(tokens), text))
        self._evict(hist)
        self._changed.add(key)

    def _evict(self, hist: PromptHistory) -> None:
        rollouts = sorted({e.rollout_id for e in hist.entries})
        keep = set(rollouts[-(self.epochs + 1):])
        hist.entries = [e for e in hist.entries if e.rollout_id in keep]
        total = hist.num_tokens
        while total > self.max_tokens:
            total -= len(hist.entries.pop(0).tokens)

    def responses(self, key: str, *, before: int | None = None) -> list[tuple[int, ...]]:
        """The prompt's stored responses, oldest first; `before` keeps only those of earlier rollouts."""
        hist = self._prompts.get(key)
        if hist is None:
            return []
        return [e.tokens for e in hist.entries if before is None or e.rollout_id < before]

    def texts(self, key: str) -> list[str]:
        hist = self._prompts.get(key)
        return [e.text for e in hist.entries if e.text] if hist else []

    def keys(self) -> list[str]:
        return list(self._prompts)

    def num_tokens(self) -> int:
        return sum(h.num_tokens for h in self._prompts.values())

    def take_changed(self) -> set[str]:
        """Keys whose history changed since the last call (what the engines' corpora must catch up on)."""
        changed, self._changed = self._changed, set()
        return changed


def corpus_id(key: str, version: int) -> str:
    """The drafting corpus of one prompt's history (embedded engine: one corpus per prompt)."""
    return f"slime-history/{key}/{version}"


def global_corpus_id(version: int) -> str:
    """Real SGLang 0.5.23 cannot select a corpus per request: one corpus holds every prompt's history."""
    return f"slime-history/all/{version}"


def corpus_documents(store: HistoryStore, keys: list[str] | None = None) -> list[str]:
    """Response texts to send as SGLang's `documents` (0.5.23's HTTP route refuses bare `token_chunks`)."""
    return [t for k in (store.keys() if keys is None else keys) for t in store.texts(k)]


def fit_documents(documents: list[str], lengths: list[int], max_tokens: int) -> list[str]:
    """The newest documents whose tokens (plus one separator between two) fit `max_tokens`, oldest first.

    SGLang silently truncates a corpus past --speculative-ngram-external-corpus-max-tokens, keeping the oldest;
    drafting gains most from the newest, so the client trims first.
    """
    kept, total = [], 0
    for doc, n in zip(reversed(documents), reversed(lengths)):
        cost = n + (1 if kept else 0)
        if total + cost > max_tokens:
            break
        kept.append(doc)
        total += cost
    return kept[::-1]
