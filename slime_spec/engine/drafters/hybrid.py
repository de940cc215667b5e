"""Hybrid drafting (embedded engine): MTP and rollout history together, chosen per row at every verify step.

NEXTN / EAGLE on the embedded engine drafts with the MTP layer. A request that carries the slime-spec extension
`slime_history` (the rollout manager adds it under --rollout-history-drafting) may instead copy from its group's
siblings and its prompt's earlier rollouts (history.py). Per row and step the drafter takes the draft with the
longer expected acceptance: history when the measured acceptance rate of history drafts at this match length
(an EMA per power-of-two length bucket) is at least the measured rate of MTP drafts, else MTP. Requests without
the extension always draft with MTP, exactly as MTPDrafter alone.

Lossless either way: a history draft is a deterministic function of tokens (q one-hot), an MTP draft keeps its
own q (draft sampling), and verification uses each row's q (sampling.speculative_accept).
"""

from __future__ import annotations

import torch

from slime_spec.engine.drafters.base import Drafter, DraftPick, argmax_pick
from slime_spec.engine.drafters.history import HistoryDrafter
from slime_spec.engine.drafters.mtp import MTPDrafter
from slime_spec.engine.model_executor.transfer import device_tensor

EMA_ALPHA = 0.1
BUCKETS = 8  # match lengths 1, 2-3, 4-7, ..., 64+ (bucket = bit length - 1)


def length_bucket(length: int) -> int:
    return min(length.bit_length() - 1, BUCKETS - 1)


class HybridDrafter(Drafter):
    """MTP for every row, history for rows whose history match is expected to accept more (module docstring).
    The engine reaches the MTP layer itself (CUDA graphs, weight updates) through `mtp`."""

    supports_tree = True
    extends_before_read_back = True
    holds_corpora = True
    owns_weights = True
    defers_plain_steps = True  # the MTP layer defers its extend; history reads the tokens when it drafts (base.py)

    def __init__(self, mtp: MTPDrafter, history: HistoryDrafter):
        self.mtp, self.history = mtp, history
        self.history_rate = [1.0] * BUCKETS  # accepted / drafted of history drafts, per match-length bucket
        self.mtp_rate = 0.5                  # accepted / drafted of MTP drafts
        self.chosen: dict[int, int] = {}     # id(row) -> bucket of the history draft it verifies, this step
        self.history_rows = 0                # rows drafted from history / by MTP (for benchmarks)
        self.mtp_rows = 0

    def catch_up_deferred(self, rows) -> bool:
        """The MTP layer's deferred extends (MTPDrafter.catch_up_deferred)."""
        return self.mtp.catch_up_deferred(rows)

    @property
    def num_steps(self) -> int:
        return self.mtp.num_steps

    @num_steps.setter
    def num_steps(self, num_steps: int) -> None:
        self.mtp.num_steps = num_steps
        self.history.num_steps = num_steps

    def new_cache(self) -> None:
        self.mtp.new_cache()

    def drop_cache(self) -> None:
        self.mtp.drop_cache()
        self.history.drop_cache()

    def weight_runner(self):
        return self.mtp.weight_runner()

    # the corpus endpoints (/add_external_corpus, ...) reach the history half
    def add_corpus(self, corpus_id: str, chunks: list[list[int]]) -> int:
        return self.history.add_corpus(corpus_id, chunks)

    def remove_corpus(self, corpus_id: str) -> None:
        self.history.remove_corpus(corpus_id)

    def list_corpora(self) -> dict[str, int]:
        return self.history.list_corpora()

    def corpus_tokens(self) -> int:
        return self.history.corpus_tokens()

    # ------------------------------------------------------------------ drafting
    def _history_rows(self, rows) -> list:
        return [r for r in rows if getattr(r.req, "history", None) is not None]

    def on_prefill(self, rows, hidden: torch.Tensor) -> None:
        self.mtp.on_prefill(rows, hidden)
        self.history.catch_up(self._history_rows(rows))

    def _history_drafts(self, rows) -> dict[int, list[int]]:
        """Row index -> its history draft (k tokens), for the rows where history is expected to accept more."""
        self.chosen = {}
        with_history = self._history_rows(rows)
        if not with_history:
            return {}
        self.history.catch_up(with_history)
        drafts, k = {}, self.num_steps
        for i, r in enumerate(rows):
            if getattr(r.req, "history", None) is None:
                continue
            length, draft = self.history.history_match(r)
            if length == 0 or self.history_rate[length_bucket(length)] < self.mtp_rate:
                continue
            drafts[i] = draft + [draft[-1]] * (k - len(draft))
            self.chosen[id(r)] = length_bucket(length)
        return drafts

    def propose(self, rows) -> torch.Tensor:
        return self.sample_draft(rows, argmax_pick)[0]

    def sample_draft(self, rows, pick: DraftPick) -> tuple[torch.Tensor, torch.Tensor | None]:
        """History rows get their copied chain (q one-hot); the others one batched MTP chain (q its own).

        The engine's `pick` for draft sampling is built for the whole batch, so then MTP drafts every row and
        history rows overwrite theirs; greedy picking (argmax, batch-free) runs MTP on the other rows only."""
        history = self._history_drafts(rows)
        self.history_rows += len(history)
        self.mtp_rows += len(rows) - len(history)
        if not history:
            return self.mtp.sample_draft(rows, pick)
        hist_idx = list(history)
        mtp_idx = [i for i in range(len(rows)) if i not in history]
        device = self.mtp.next_hidden.device
        if pick is argmax_pick:
            tokens = torch.empty(len(rows), self.num_steps, dtype=torch.long, device=device)
            if mtp_idx:
                tokens[mtp_idx] = self.mtp.sample_draft([rows[i] for i in mtp_idx], pick)[0]
            q = None
        else:
            tokens, q = self.mtp.sample_draft(rows, pick)
        tokens[hist_idx] = device_tensor([history[i] for i in hist_idx], device, torch.long)
        if q is not None:
            q[hist_idx] = torch.nn.functional.one_hot(tokens[hist_idx], q.shape[-1]).to(q.dtype)
        return tokens, q

    def tree_draft(self, rows, shape):
        """Tree drafting (eagle_topk > 1) is MTP's for every row: history drafts are chains."""
        return self.mtp.tree_draft(rows, shape)

    def tree_graphs(self, shape, common: dict) -> list:
        """The MTP layer's tree graphs (MTPDrafter.tree_graphs)."""
        return self.mtp.tree_graphs(shape, common)

    def defer(self, rows, hidden: torch.Tensor, positions: list[int]) -> None:
        """A plain step read back by the overlap schedule: the MTP layer's deferred extend (MTPDrafter.defer)."""
        self.mtp.defer(rows, hidden, positions)

    def on_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None:
        """The MTP layer extends over the verified positions of every row (history rows too: its KV cache must
        hold them); each row's acceptance updates the rate of the source it drafted from."""
        self.mtp.on_verify(rows, hidden, accepted)
        self.after_verify(rows, accepted)

    def verify_extend(self, rows, hidden: torch.Tensor, chosen: torch.Tensor, accepted: torch.Tensor,
                      start: torch.Tensor, slots: torch.Tensor) -> None:
        """The MTP layer's extend from the verify's device tensors, before the read-back (MTPDrafter.verify_extend)."""
        self.mtp.verify_extend(rows, hidden, chosen, accepted, start, slots)

    def after_verify(self, rows, accepted: list[int]) -> None:
        """Each row's acceptance updates the rate of the source it drafted from (after the read-back)."""
        k = self.num_steps
        if k > 0:
            for r, a in zip(rows, accepted):
                bucket = self.chosen.get(id(r))
                if bucket is None:
                    self.mtp_rate += EMA_ALPHA * (a / k - self.mtp_rate)
                else:
                    self.history_rate[bucket] += EMA_ALPHA * (a / k - self.history_rate[bucket])
        self.chosen = {}
