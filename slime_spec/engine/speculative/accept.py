"""How drafts are picked and accepted: SGLang's greedy rule, and the lossless rule for sampled rows. Pure functions
of logits, drafts and the batch's sampling parameters."""

from __future__ import annotations

import torch

from slime_spec.engine.drafters.base import DraftPick, argmax_pick
from slime_spec.engine.model_executor import sampling


def draft_pick(params: sampling.BatchParams, generator: torch.Generator, draft_sampling: bool) -> DraftPick:
    """Greedy rows (and every row without draft sampling) take the draft's argmax; with draft sampling a sampled
    row draws from the draft's own temperature/filter-adjusted distribution q, returned for verification."""
    p = params
    if not draft_sampling or p.all_greedy:
        return argmax_pick

    if p.all_sampled:  # the RL case: every row sampled, no per-row copies
        def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q = p.sampled_probs(logits.float())
            return sampling.sample(q, generator), q

        return pick

    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_sampled = p.sampled_probs(p.of_sampled(logits).float())
        tokens = logits.argmax(-1).index_copy_(0, p.sampled, sampling.sample(q_sampled, generator))
        return tokens, q_sampled.new_zeros(logits.shape).index_copy_(0, p.sampled, q_sampled)

    return pick


def accept_drafts(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                  params: sampling.BatchParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [n], the token after them [n]) per row: greedy rows by argmax equality, sampled rows by
    the lossless rule. A batch of one kind (the usual case: all sampled in RL) skips the per-kind row copies."""
    p = params
    if p.all_greedy:
        return sampling.greedy_accept(logits, drafts)
    k1, vocab = logits.shape[1:]
    probs = p.sampled_probs(p.of_sampled(logits).flatten(0, 1), reps=k1).view(-1, k1, vocab)
    q = None if draft_probs is None else p.of_sampled(draft_probs)
    sampled_accept = sampling.speculative_accept(probs, q, p.of_sampled(drafts), generator)
    if p.all_sampled:
        return sampled_accept
    accept, next_token = sampling.greedy_accept(logits, drafts)  # every row; the sampled rows' are replaced
    return accept.index_copy_(0, p.sampled, sampled_accept[0]), next_token.index_copy_(0, p.sampled, sampled_accept[1])
