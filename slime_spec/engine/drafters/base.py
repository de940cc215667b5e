"""The drafter base class and the helpers every drafter shares.

A drafter proposes k tokens per running row; the speculative worker (engine/speculative/) verifies them with
one batched target forward.

By default every drafter drafts greedily (SGLang's eagle_topk 1 chain picks the draft's argmax; NGRAM copies
tokens), so the draft distribution q is one-hot and verification (see sampling.speculative_accept) is lossless.
Chain drafters with a distribution (MTP, STANDALONE) override `sample_draft(rows, pick)`: the worker's `pick`
turns each step's draft logits into tokens and, when drafting by sampling, the distribution q each token was
sampled from; verification then uses q (accept with min(1, p/q), resample from max(0, p - q)).

Row state the engine keeps (see request.Row): `tokens` (prompt + output), `kv_len` (tokens whose keys/values are
in the target cache: all but the last, pending one), `slot` (cache row). The settings come from
`slime_spec.speculative.settings.SpecConfig`, resolved and checked for this engine before `make_drafter` runs.

Every hook of `Drafter` has a no-op default, and what a drafter can do is declared as class attributes, so the
engine calls hooks and checks capabilities instead of probing for attributes.
"""

from __future__ import annotations

from typing import Callable

import torch

from slime_spec.engine.model_executor.transfer import device_tensor


class Drafter:
    """What the engine calls on a drafter, and when. Subclasses override `propose` and the hooks they need.

    num_steps: draft tokens of the next verify (SGLang's speculative_num_steps; NGRAM's num_draft_tokens - 1, see
    SpecConfig.num_steps). The worker sets it per step (adaptive and auto speculation, 0 = a plain step), at most to
    the value the drafter was built with; read it in propose and on_verify. k below is short for it.
    """

    # ---- capabilities
    defers_plain_steps: bool = False
    """Whether a plain step (k = 0) needs nothing from the drafter until the step is read back, a step late: then
    the overlap schedule (engine/managers/overlap.py) may run a chain's plain steps, handing each read-back step to
    `defer`;
    the worker runs `catch_up_deferred` before the next chain draft, timed as the switch back from k = 0."""
    supports_tree: bool = False
    """Whether `tree_draft` drafts a tree per row (eagle_topk > 1: MTP, EAGLE3, STANDALONE;
    engine/speculative/tree.py)."""
    extends_before_read_back: bool = False
    """Whether a chain verify hands the drafter its device results before the step's read-back (`verify_extend`)
    and the read-back acceptance after it (`after_verify`), instead of `on_verify` after the read-back."""
    holds_corpora: bool = False
    """Whether the drafter serves SGLang's external corpus endpoints (add_corpus, remove_corpus, list_corpora)."""
    owns_weights: bool = False
    """Whether the draft has weights that updates reach (`weight_runner` is not None): what SGLang's manager asks of
    the draft worker at every begin, update and end of a weight session, so it is declared, not built."""
    aux_layer_ids: list[int] | None = None
    """Target layers whose outputs the drafter reads instead of the final hidden state (EAGLE3), or None."""
    draft: torch.nn.Module | None = None
    """The drafter's own network, when it has one apart from the target (STANDALONE, EAGLE3)."""

    num_steps: int

    # ---- drafting
    def propose(self, rows) -> torch.Tensor:
        """LongTensor [B, k]: draft tokens following each row's pending token."""
        raise NotImplementedError(f"{type(self).__name__} must implement propose")

    def sample_draft(self, rows, pick: "DraftPick") -> tuple[torch.Tensor, torch.Tensor | None]:
        """(drafts [B, k], q [B, k, V] or None): drafts picked by the worker's `pick` (draft sampling). A drafter
        without a distribution (NGRAM, history) proposes deterministically: q is one-hot, so None."""
        return self.propose(rows), None

    def tree_draft(self, rows, shape):
        """A tree.DraftTree per batch (eagle_topk > 1); only where `supports_tree`."""
        raise NotImplementedError(f"{type(self).__name__} drafts chains only (supports_tree is False)")

    # ---- keeping in sync with the target
    def on_prefill(self, rows, hidden: torch.Tensor) -> None:
        """After the target prefilled rows and appended their first token."""

    def on_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None:
        """After the verify pass appended accepted[i] + 1 tokens to rows[i] (a plain step: k = 0, all zero)."""

    def on_tree_verify(self, rows, hidden: torch.Tensor, accepted: list[int]) -> None:
        """After a tree verify, with the accepted path's states; chain bookkeeping unless a drafter differs."""
        self.on_verify(rows, hidden, accepted)

    def verify_extend(self, rows, hidden: torch.Tensor, chosen: torch.Tensor, accepted: torch.Tensor,
                      start: torch.Tensor, slots: torch.Tensor) -> None:
        """The drafter's extend from a chain verify's device tensors, queued before the read-back
        (`extends_before_read_back`)."""

    def after_verify(self, rows, accepted: list[int]) -> None:
        """The read-back acceptance of the rows still running, after `verify_extend`."""

    def defer(self, rows, hidden: torch.Tensor, positions: list[int]) -> None:
        """A plain step read back by the overlap schedule (`defers_plain_steps`)."""

    def catch_up_deferred(self, rows) -> bool:
        """Run the work deferred from earlier plain steps and the prefill; whether anything ran."""
        return False

    # ---- weights, caches, graphs
    def weight_runner(self) -> dict[str, torch.nn.Parameter] | None:
        """The draft's weights by HF name, as SGLang's draft runner loads them; None without weights."""
        return None

    def new_cache(self) -> None:
        """(Re)allocate the drafter's KV cache."""

    def drop_cache(self) -> None:
        """Free the drafter's KV cache."""

    def capture_graphs(self, settings, max_running_requests: int) -> float:
        """On CUDA, capture the drafter's own chain graphs (not the target's); returns the capture seconds."""
        return 0.0

    def tree_graphs(self, shape, common: dict) -> list:
        """On CUDA, the tree draft steps and extend as graphs (engine/speculative/tree_graphs.py), installed where the
        drafter
        replays them."""
        return []

    def drop_graphs(self) -> None:
        """Forget graphs captured on storage that is being freed; the engine captures them again on resume."""


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
