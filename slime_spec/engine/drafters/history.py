"""History drafting: copy from the request's group siblings, its prompt's earlier rollouts, and external corpora.

Every source is a suffix automaton (SAM), extended online as siblings generate. Each row keeps a streaming
match per source (`SuffixAutomaton.step`), so finding the longest suffix of its context that occurs in a source
costs O(new tokens) per step, whatever the source's size (no linear scan, no rebuild). The draft is the chain
that followed that occurrence: O(k). Drafts are a deterministic function of tokens (a one-hot q), so verification stays
lossless (see sampling.speculative_accept).

Sources per running row, best match wins (longest matched suffix, then the longest continuation):
  - siblings: every row of the row's group (the slime-spec request extension `slime_history.group`), running
    or finished, the row itself included (its own output, like NGRAM);
  - history: the external corpus named by `slime_history.corpus_id` (the rollout manager mirrors the prompt's
    earlier responses into it); without the extension, every external corpus, as SGLang 0.5.23 drafts from all;
  - the engine-wide n-gram cache (`NgramDrafter`, shared across requests as SGLang's trie is).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from slime_spec.engine.drafters.base import Drafter
from slime_spec.engine.drafters.ngram import NgramDrafter
from slime_spec.engine.model_executor.transfer import device_tensor

SEPARATOR = -(2**31)  # between documents of one corpus (SGLang 0.5.23's SEPARATOR_TOKEN); no match crosses it
MAX_GROUPS = 64  # groups whose sibling automata are kept (least recently drafted dropped first; bounds memory)


@dataclass(frozen=True)
class HistoryRef:
    """The slime-spec `/generate` extension `slime_history`: which group and corpus a request drafts from."""

    group: str | None = None
    corpus_id: str | None = None


class SuffixAutomaton:
    """An online suffix automaton over one growing token sequence (documents split by SEPARATOR).

    State s stands for a set of substrings sharing their end positions; `first[s]` is the earliest end position,
    so `text[first[s] + 1:]` is what followed the earliest occurrence.
    """

    def __init__(self, tokens: list[int] | None = None):
        self.next: list[dict[int, int]] = [{}]
        self.link, self.length, self.first = [-1], [0], [-1]
        self.last = 0
        self.text: list[int] = []
        if tokens:
            self.extend(tokens)

    def __len__(self) -> int:
        return len(self.text)

    def extend(self, tokens) -> None:
        """Append tokens (the standard online construction, amortized O(1) each; locals for speed)."""
        nxt, link, length, first, text = self.next, self.link, self.length, self.first, self.text
        last = self.last
        for c in tokens:
            c = int(c)
            cur = len(length)
            nxt.append({})
            link.append(0)
            length.append(length[last] + 1)
            first.append(len(text))
            text.append(c)
            p = last
            while p != -1 and c not in nxt[p]:
                nxt[p][c] = cur
                p = link[p]
            if p != -1:
                q = nxt[p][c]
                if length[p] + 1 == length[q]:
                    link[cur] = q
                else:
                    clone = len(length)
                    nxt.append(dict(nxt[q]))
                    link.append(link[q])
                    length.append(length[p] + 1)
                    first.append(first[q])
                    while p != -1 and nxt[p].get(c) == q:
                        nxt[p][c] = clone
                        p = link[p]
                    link[q] = link[cur] = clone
            last = cur
        self.last = last

    def match(self, context: list[int], max_depth: int) -> tuple[int, int]:
        """(length, end) of the longest suffix of context[-max_depth:] occurring here with a token after it."""
        state, length = 0, 0
        for t in context[-max_depth:]:
            while state and t not in self.next[state]:
                state = self.link[state]
                length = self.length[state]
            if t in self.next[state]:
                state, length = self.next[state][t], length + 1
            else:
                state, length = 0, 0
        while state > 0:
            end = self.first[state]
            if end + 1 < len(self.text) and self.text[end + 1] != SEPARATOR:
                return length, end
            state = self.link[state]
            length = self.length[state]
        return 0, -1

    def step(self, state: int, length: int, t: int) -> tuple[int, int]:
        return self.advance(state, length, (t,))

    def advance(self, state: int, length: int, tokens) -> tuple[int, int]:
        """Advance a streaming match (state, length) by context tokens: amortized O(1) each.

        The automaton may have grown since the match was taken; a clone made since then holds the shorter
        strings of the old state, so the state is first moved up to the one that holds `length` now."""
        link, lengths, nxt = self.link, self.length, self.next
        while state > 0 and length <= lengths[link[state]]:
            state = link[state]
        for t in tokens:
            while state and t not in nxt[state]:
                state = link[state]
                length = lengths[state]
            if t in nxt[state]:
                state, length = nxt[state][t], length + 1
            else:
                state, length = 0, 0
        return state, length

    def occurrence(self, state: int, length: int) -> tuple[int, int]:
        """(length, end) of the longest suffix of a streaming match whose earliest occurrence has a token after
        it; (0, -1) if none. Walks suffix links, usually none or one."""
        text = self.text
        while state > 0:
            end = self.first[state]
            if end + 1 < len(text) and text[end + 1] != SEPARATOR:
                return length, end
            state = self.link[state]
            length = self.length[state]
        return 0, -1

    def continuation(self, end: int, k: int) -> list[int]:
        out = self.text[end + 1:end + 1 + k]
        return out[:out.index(SEPARATOR)] if SEPARATOR in out else out


def corpus_automaton(chunks: list[list[int]]) -> SuffixAutomaton:
    """One automaton over token chunks: chunks concatenate (as SGLang's SAM loads them); SEPARATOR splits docs."""
    sam = SuffixAutomaton()
    for chunk in chunks:
        sam.extend(chunk)
    return sam


def best_draft(context: list[int], sources, k: int, max_depth: int) -> tuple[int, list[int]]:
    """The continuation after the longest suffix match over `sources`, extended by re-matching up to k tokens.

    A from-scratch reference (O(max_depth) per source and call); the drafter matches incrementally instead."""
    draft: list[int] = []
    first_len = 0
    while len(draft) < k:
        best: tuple[int, int, list[int]] = (0, 0, [])
        for sam in sources:
            length, end = sam.match(context + draft, max_depth)
            if length == 0:
                continue
            cont = sam.continuation(end, k - len(draft))
            if (length, len(cont)) > best[:2]:
                best = (length, len(cont), cont)
        if not best[2]:
            break
        if not draft:
            first_len = best[0]
        draft += best[2]
    return first_len, draft


class HistoryDrafter(Drafter):
    """NGRAM on the embedded engine: the shared n-gram cache plus SAM sources (module docstring).

    ngram None: history sources only (the hybrid drafter's history half, see hybrid.py). Each row keeps one
    streaming match per source, advanced only by the tokens appended since its last draft, so a draft costs
    O(new tokens + k) per source instead of re-matching the context.
    """

    holds_corpora = True
    defers_plain_steps = False  # as NgramDrafter: NGRAM does not run under the overlap schedule

    def __init__(self, ngram: NgramDrafter | None, max_depth: int, num_steps: int | None = None, device=None):
        self.ngram, self.max_depth = ngram, max_depth
        self.device = ngram.device if ngram is not None else device
        self._num_steps = ngram.num_steps if ngram is not None else num_steps
        self.corpora: dict[str, SuffixAutomaton] = {}
        self.groups: OrderedDict[str, dict[str, SuffixAutomaton]] = OrderedDict()  # group -> rid -> output SAM

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @num_steps.setter
    def num_steps(self, num_steps: int) -> None:
        """The engine sets the draft length per step (adaptive / auto): the n-gram matcher drafts that many too."""
        self._num_steps = num_steps
        if self.ngram is not None:
            self.ngram.num_steps = num_steps

    def drop_cache(self) -> None:
        """The shared n-gram cache and the sibling automata go; external corpora stay (SGLang keeps them)."""
        if self.ngram is not None:
            self.ngram.drop_cache()
        self.groups.clear()

    # ------------------------------------------------------------------ external corpora (SGLang's endpoints)
    def add_corpus(self, corpus_id: str, chunks: list[list[int]]) -> int:
        if corpus_id in self.corpora:
            raise ValueError(f"External corpus '{corpus_id}' already exists. Remove it before adding a new corpus "
                             "with the same id.")
        sam = corpus_automaton(chunks)
        if not len(sam):
            raise ValueError("External corpus is empty — no tokens were loaded.")
        self.corpora[corpus_id] = sam
        return len(sam)

    def remove_corpus(self, corpus_id: str) -> None:
        self.corpora.pop(corpus_id, None)

    def list_corpora(self) -> dict[str, int]:
        return {cid: len(sam) for cid, sam in self.corpora.items()}

    def corpus_tokens(self) -> int:
        return sum(len(s) for s in self.corpora.values())

    # ------------------------------------------------------------------ drafting
    def _sibling(self, r) -> SuffixAutomaton | None:
        ref = getattr(r.req, "history", None)
        if ref is None or ref.group is None:
            return None
        group = self.groups.get(ref.group)
        if group is None:
            group = self.groups[ref.group] = {}
            while len(self.groups) > MAX_GROUPS:
                self.groups.popitem(last=False)
        self.groups.move_to_end(ref.group)
        sam = group.get(r.req.rid)
        if sam is None:
            sam = group[r.req.rid] = SuffixAutomaton()
        sam.extend(r.tokens[r.prompt_len + len(sam):])
        return sam

    def _sources(self, r) -> list[SuffixAutomaton]:
        ref = getattr(r.req, "history", None)
        sources = []
        if ref is not None and ref.group is not None:
            sources += list(self.groups.get(ref.group, {}).values())
        if ref is not None and ref.corpus_id is not None:
            corpus = self.corpora.get(ref.corpus_id)
            sources += [corpus] if corpus is not None else []
        elif ref is None:
            sources += list(self.corpora.values())
        return sources

    def history_match(self, r) -> tuple[int, list[int]]:
        """(matched suffix length, up to k continuation tokens) over the row's SAM sources; (0, []) if none.

        Longest match wins, then the longest continuation. Each source's streaming match starts max_depth
        tokens back the first time the row meets it and then only reads the row's new tokens."""
        cursors = r.draft_state.get("history")  # source -> [state, length, tokens read]
        if cursors is None:
            cursors = r.draft_state["history"] = {}
        tokens, n, k = r.tokens, len(r.tokens), self._num_steps
        best_len, best = 0, []
        for sam in self._sources(r):
            cur = cursors.get(sam)
            if cur is None:
                cur = cursors[sam] = [0, 0, max(0, n - self.max_depth)]
            state, length = sam.advance(cur[0], cur[1], tokens[cur[2]:])
            cur[0], cur[1], cur[2] = state, length, n
            length, end = sam.occurrence(state, length)
            if length < best_len or length == 0:
                continue
            cont = sam.continuation(end, k)
            if length > best_len or len(cont) > len(best):
                best_len, best = length, cont
        return (best_len, best) if best else (0, [])

    def draft_for(self, r) -> list[int]:
        length, draft = self.history_match(r)
        if self.ngram is not None:
            ngram_len, ngram_draft = self.ngram.match(r)
            if not (length > ngram_len or (length == ngram_len and length and len(draft) > len(ngram_draft))):
                draft = ngram_draft
        if not draft:
            draft = [r.tokens[-1]]
        return draft + [draft[-1]] * (self._num_steps - len(draft))

    def catch_up(self, rows) -> None:
        """Every row's n-grams and sibling automaton take its new tokens before any row drafts from them."""
        for r in rows:
            if self.ngram is not None:
                self.ngram._index(r)
            self._sibling(r)

    def on_prefill(self, rows, hidden: torch.Tensor | None = None) -> None:
        self.catch_up(rows)

    def propose(self, rows) -> torch.Tensor:
        self.catch_up(rows)
        return device_tensor([self.draft_for(r) for r in rows], self.device, torch.long)
