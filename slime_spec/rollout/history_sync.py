"""Keeps the engines' drafting corpora in step with the rollout-history store (issue #16).

Embedded engine: one corpus per prompt (`history.corpus_id`), named in each request by the slime-spec
`/generate` extension `slime_history` together with the request's group, so a request drafts from its own
prompt's earlier answers and from its running siblings.

Real SGLang 0.5.23: a request cannot name a corpus, and NGRAM drafts from every loaded corpus, splitting
--speculative-ngram-external-sam-budget draft nodes evenly among them. So one corpus holds every prompt's
history (the newest responses that fit --speculative-ngram-external-corpus-max-tokens), replaced after each
rollout (removed first, so old and new never count twice against that budget). The group's siblings in
flight need nothing there: SGLang's n-gram trie is shared by all requests.

Corpora travel as `documents` (response texts): 0.5.23's /add_external_corpus refuses bare `token_chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slime_spec.rollout.history import (
    HistoryStore,
    corpus_documents,
    corpus_id,
    fit_documents,
    global_corpus_id,
    prompt_key,
)
from slime_spec.rollout.sample import Sample, Status

REQUEST_EXTENSION = "request_extension"  # Sample.metadata key: fields default_generate adds to its /generate


@dataclass
class HistorySync:
    """What the manager calls around each rollout: `before_rollout` (tag samples, push corpora), `after_rollout`.

    use_group / use_epochs pick the sources (both by default; the benchmark measures each alone).
    """

    store: HistoryStore
    backend: str                       # "embedded" or "sglang"
    corpus_max_tokens: int             # SGLang's --speculative-ngram-external-corpus-max-tokens
    use_group: bool = True
    use_epochs: bool = True
    corpora: dict[str, str] = field(default_factory=dict)  # prompt key -> its corpus id on every engine
    global_corpus: str | None = None

    def tag(self, samples: list[Sample], rollout_id: int) -> None:
        """Embedded engine: each sample's /generate carries its group and its prompt's corpus."""
        if self.backend != "embedded":
            return
        for s in samples:
            key = prompt_key(s.tokens[: s.prompt_length])
            ext = {}
            if self.use_group:
                ext["group"] = f"{rollout_id}/{s.group_index}"
            if self.use_epochs and key in self.corpora:
                ext["corpus_id"] = self.corpora[key]
            if ext:
                s.metadata[REQUEST_EXTENSION] = {"slime_history": ext}

    def after_rollout(self, samples: list[Sample], rollout_id: int) -> None:
        for s in samples:
            if s.status != Status.ABORTED and s.response_length:
                self.store.add(prompt_key(s.tokens[: s.prompt_length]), rollout_id,
                               s.tokens[s.prompt_length:], s.response)

    async def push(self, clients, rollout_id: int, tokenizer=None) -> None:
        """Bring every engine's corpora up to the store (the keys changed since the last push)."""
        changed = sorted(self.store.take_changed())
        if not changed or not self.use_epochs:
            return
        if self.backend == "embedded":
            for key in changed:
                new_id = corpus_id(key, rollout_id)
                docs = self.store.texts(key)
                if docs:
                    for c in clients:
                        await c.add_external_corpus(new_id, docs)
                old = self.corpora.pop(key, None)
                if old is not None:
                    for c in clients:
                        await c.remove_external_corpus(old)
                if not docs:
                    continue
                self.corpora[key] = new_id
            return
        docs = corpus_documents(self.store)
        lengths = [len(tokenizer.encode(d, add_special_tokens=False)) for d in docs] if tokenizer else \
            [len(d) for d in docs]
        docs = fit_documents(docs, lengths, self.corpus_max_tokens)
        # One engine at a time: SGLang refuses a second load while one is in progress.
        if self.global_corpus is not None:
            for c in clients:
                await c.remove_external_corpus(self.global_corpus)
            self.global_corpus = None
        if docs:
            new_id = global_corpus_id(rollout_id)
            for c in clients:
                await c.add_external_corpus(new_id, docs)
            self.global_corpus = new_id

    async def before_rollout(self, clients, samples: list[Sample], rollout_id: int, tokenizer=None) -> None:
        await self.push(clients, rollout_id, tokenizer)
        self.tag(samples, rollout_id)


SGLANG_CORPUS_MAX_TOKENS = 10_000_000  # SGLang 0.5.23's --speculative-ngram-external-corpus-max-tokens default


def make_history_sync(rollout, engine) -> HistorySync | None:
    """From the typed configs: None unless --rollout-history-drafting (doctor checked NGRAM and the budgets)."""
    if not rollout.rollout_history_drafting:
        return None
    store = HistoryStore(rollout.rollout_history_epochs, rollout.rollout_history_max_tokens)
    budget = engine.server_args.get("speculative_ngram_external_corpus_max_tokens") or SGLANG_CORPUS_MAX_TOKENS
    return HistorySync(store, engine.backend, int(budget), use_epochs=rollout.rollout_history_epochs > 0)
