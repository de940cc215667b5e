"""How drafts are picked and accepted: SGLang's greedy rule, and the lossless rule for sampled rows. Pure functions
of logits, drafts and the batch's sampling parameters."""

from __future__ import annotations

import math

import torch

from slime_spec.engine.drafters.base import DraftPick, argmax_pick
from slime_spec.engine.kernels.sampling import sample_rows
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


def accept_unfiltered(logits: torch.Tensor, drafts: torch.Tensor, temperatures: torch.Tensor,
                      generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lossless rule for a batch of rows sampled at their temperatures alone, with deterministic drafts, from one
    pass of the sampling kernel over logits [n, k + 1, V] (any float dtype, unmasked): (accepted drafts [n], the
    token after them [n], logprobs [n, k + 1] of the drafts then that token, broken rows [n]).

    Draft j is accepted with probability p_j(d_j); at the first rejection the residual max(p_j - onehot(d_j), 0)
    is p_j without d_j, renormalised: the kernel's draw at position j excluding d_j; after k acceptances, its draw
    from p_k. A row with a non-finite logit accepts nothing, gets logprobs of -log V (those of the zeroed logits
    the eager path samples from) and is finished by the caller."""
    n, k1, vocab = logits.shape
    k = k1 - 1
    excluded = torch.cat((drafts, drafts.new_full((n, 1), -1)), dim=1).flatten()  # also the probed tokens
    drawn = sample_rows(logits.view(n * k1, vocab), temperatures.repeat_interleave(k1), generator,
                        exclude=excluded, probe=excluded)
    lse, probe_z = drawn.lse.view(n, k1), drawn.probe_z.view(n, k1)
    broken = ~drawn.finite.view(n, k1).all(1)
    u = torch.rand((n, k), generator=generator, device=logits.device)
    accepted = u < torch.exp(probe_z[:, :k] - lse[:, :k])
    accept = torch.cumprod(accepted.to(torch.int64), dim=-1).sum(-1).masked_fill_(broken, 0)
    next_token = drawn.tokens.view(n, k1).gather(1, accept[:, None])[:, 0]
    at_next = torch.arange(k1, device=logits.device)[None, :] == accept[:, None]
    logprobs = torch.where(at_next, drawn.token_z.view(n, k1), probe_z) - lse
    return accept, next_token, logprobs.masked_fill_(broken[:, None], -math.log(vocab)), broken
