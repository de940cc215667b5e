"""Sampling and speculative acceptance as pure tensor functions (one row per request, per-row parameters).

Filtering is SGLang's `top_k_top_p_min_p_sampling_from_probs_torch` (sglang/srt/layers/sampler.py; the conformance
test runs it against `filtered_probs`):
probs = softmax(logits / temperature); on the probs sorted descending, zero ranks >= top_k, zero every
entry whose preceding cumulative mass already exceeds top_p (cumsum computed before the top-k zeroing),
then zero entries below min_p * max prob. A request is greedy when temperature == 0 or top_k == 1
(SGLang normalises temperature < 1e-6 to top_k = 1); greedy picks argmax of the raw logits.

Returned logprobs follow SGLang's default (SGLANG_RETURN_ORIGINAL_LOGPROB unset, no rl-on-policy mode):
greedy rows get log_softmax(logits); sampled rows get log(softmax(logits / temperature)), i.e. temperature
applied but top-k / top-p / min-p not (SGLang takes the log of the probabilities before filtering).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from slime_spec.engine.model_executor.transfer import device_tensor

SAMPLING_EPS = 1e-6


class BatchParams(NamedTuple):
    """A batch's sampling parameters, one per row on the device, and what is known of them on the host, so that
    no step reads the device to find out which rows are sampled or filtered (a boolean mask over device rows, or a
    bool() of a device test, waits for the stream). Built by `batch_params`, once per batch composition; how many
    rows an index tensor holds is known on the host (its shape)."""

    greedy: torch.Tensor
    temps: torch.Tensor
    top_ks: torch.Tensor   # the vocabulary size where top-k is off
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    sampled: torch.Tensor  # indices of the sampled rows, ascending (all rows when all_sampled)
    sampled_params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (temps, top_ks, top_ps, min_ps)
    sorting: torch.Tensor  # indices among the sampled rows of those with an active top-k or top-p filter
    all_greedy: bool
    all_sampled: bool
    min_p: bool            # some sampled row has an active min-p filter

    @property
    def unfiltered(self) -> bool:
        """Every row sampled at its temperature alone (no top-k, top-p or min-p): RL's rollouts, and what the
        sampling kernel serves (kernels/sampling.py)."""
        return self.all_sampled and not self.sorting.numel() and not self.min_p

    def of_sampled(self, t: torch.Tensor) -> torch.Tensor:
        """The sampled rows of `t` (one row per batch row), in row order; `t` itself when every row is sampled."""
        return t if self.all_sampled else t.index_select(0, self.sampled)

    def sampled_probs(self, logits: torch.Tensor, reps: int = 1) -> torch.Tensor:
        """filtered_probs of the sampled rows' logits [S * reps, V], each row's `reps` positions consecutive."""
        params, sorting = self.sampled_params, self.sorting
        if reps > 1:
            params = [x.repeat_interleave(reps) for x in params]
            if sorting.numel():
                sorting = (sorting[:, None] * reps + torch.arange(reps, device=sorting.device)).flatten()
        return filtered_probs(logits, *params, sort_rows=sorting, min_p=self.min_p)


def batch_params(params: list, vocab_size: int, device) -> BatchParams:
    """BatchParams of the rows' SamplingParams (temperature, top_k, top_p, min_p): the host flags from the values,
    the device tensors (the index tensors included) through one pinned, non-blocking copy."""
    greedy = [is_greedy(x.temperature, x.top_k) for x in params]
    top_ks = [x.top_k if x.top_k > 0 else vocab_size for x in params]
    sampled = [i for i, g in enumerate(greedy) if not g]
    sorting = [j for j, i in enumerate(sampled) if top_ks[i] < vocab_size or params[i].top_p < 1.0]
    pad = lambda index: index + [0] * (len(params) - len(index))  # noqa: E731 (index lists ride as columns)
    columns = [[x.temperature for x in params], top_ks, [x.top_p for x in params], [x.min_p for x in params],
               [float(g) for g in greedy], pad(sampled), pad(sorting)]
    values = device_tensor(list(zip(*columns)), device, torch.float64)
    rows = values[: len(sampled), 5].long()
    per_row = values[:, 0].float(), values[:, 1].long(), values[:, 2].float(), values[:, 3].float()
    all_sampled = len(sampled) == len(params)
    return BatchParams(values[:, 4].bool(), *per_row, rows,
                       per_row if all_sampled else tuple(t.index_select(0, rows) for t in per_row),
                       values[: len(sorting), 6].long(), all_greedy=not sampled, all_sampled=all_sampled,
                       min_p=any(params[i].min_p > 0 for i in sampled))


def non_finite(logits: torch.Tensor) -> torch.Tensor:
    """broken [rows]: whether a row (over the first dimension) holds a NaN or inf; nothing changed, nothing read
    back."""
    return ~torch.isfinite(logits).flatten(1).all(-1)


def finite_float32(logits: torch.Tensor) -> torch.Tensor:
    """The logits the eager sampler reads: float32, every row with a NaN or inf zeroed (as mask_non_finite).
    A float32 `logits` is masked in place, so it must be a fresh tensor."""
    return mask_non_finite(logits.float())[0]


def mask_non_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with every row that holds NaN/inf zeroed in place, so sampling still runs; broken [rows]), rows
    over the first dimension. Nothing is read back: the caller finishes broken rows from its one read-back, as
    SGLang finishes them ("NaN happened") instead of crashing the batch. `logits` must be a fresh tensor."""
    broken = non_finite(logits)
    return logits.masked_fill_(broken.view(-1, *([1] * (logits.dim() - 1))), 0.0), broken


def is_greedy(temperature: float, top_k: int) -> bool:
    return temperature < SAMPLING_EPS or top_k == 1


def filtered_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                   min_ps: torch.Tensor, sort_rows: torch.Tensor | None = None,
                   min_p: bool | None = None) -> torch.Tensor:
    """logits [N, V] float32, params [N] -> normalized sampling distribution [N, V] after SGLang's filters.

    top_ks uses the vocabulary size (or more) for "off". Greedy rows should not be passed here.
    sort_rows (the rows with an active top-k or top-p filter) and min_p (whether some row has an active min-p
    filter) as the host knows them (BatchParams); None reads them from the device, which waits for the stream.
    Only the sort_rows pay for the full-vocabulary sort (the RL default, top_p 1, top_k -1, is a plain softmax);
    min-p needs only each row's max, which no other filter removes.
    """
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    if sort_rows is None:
        sort_rows = ((top_ks < probs.shape[-1]) | (top_ps < 1.0)).nonzero().flatten()
    if min_p is None:
        min_p = bool((min_ps > 0).any())
    sorts = sort_rows.numel()
    if not (sorts or min_p):
        return probs
    if sorts == len(probs):
        probs = _top_k_top_p(probs, top_ks, top_ps)
    elif sorts:
        rows = [t.index_select(0, sort_rows) for t in (probs, top_ks, top_ps)]
        probs.index_copy_(0, sort_rows, _top_k_top_p(*rows))
    if min_p:
        probs = probs.masked_fill(probs < probs.amax(-1, keepdim=True) * min_ps[:, None], 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """SGLang's top-k then top-p on descending-sorted probs (the cumsum taken before the top-k zeroing)."""
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    probs_sort = probs_sort.masked_fill(ranks >= top_ks[:, None], 0.0)
    probs_sort = probs_sort.masked_fill((probs_sum - probs_sort) > top_ps[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(-1, probs_idx, probs_sort)


def output_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """[N, V] logprobs as SGLang returns them by default (see module docstring)."""
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    return torch.log_softmax(logits / scale[:, None], dim=-1)


def token_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor,
                   tokens: torch.Tensor) -> torch.Tensor:
    """output_logprobs(...) at one token per row [N], without materialising the [N, V] log-softmax."""
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures)[:, None]
    return (logits.gather(-1, tokens[:, None]) / scale - torch.logsumexp(logits / scale, dim=-1, keepdim=True))[:, 0]


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from normalized probs [N, V]: argmax(p / E) with E ~ Exponential(1) i.i.d. draws token i
    with probability p_i (the exponential race), in O(N V) elementwise work instead of multinomial's CDF search."""
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(-1)


def speculative_accept(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard speculative sampling (Leviathan et al. / Chen et al.) for a chain of k draft tokens.

    target_probs [N, k+1, V]: the target's filtered distribution at each draft position plus the bonus position.
    draft_probs [N, k, V] or None: the draft's distribution q; None means a deterministic draft (q one-hot at
      the drafted token: MTP/STANDALONE greedy drafts, NGRAM).
    draft_tokens [N, k].
    Token j is accepted with probability min(1, p(x)/q(x)); at the first rejection the next token is drawn from
    normalize(max(p - q, 0)); if all k are accepted the bonus token is drawn from p at position k.
    Returns (accept_len [N] in 0..k, next_token [N]: the residual or bonus token).
    The residual is built only at each row's stopping position: O(N V), not O(N k V).
    """
    n, k = draft_tokens.shape
    rows = torch.arange(n, device=draft_tokens.device)
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else \
        draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = torch.rand(p_draft.shape, generator=generator, device=p_draft.device, dtype=p_draft.dtype)
    accepted = u * q_draft < p_draft  # u < p/q without dividing by zero
    accept_len = torch.cumprod(accepted.to(torch.int64), dim=-1).sum(-1)
    p_stop = target_probs[rows, accept_len]
    rejected = accept_len < k
    at = accept_len.clamp_max(max(k - 1, 0))
    if draft_probs is None:  # one-hot at the stopping draft (a scatter_ of a number copies nothing to the device)
        q_stop = torch.zeros_like(p_stop)
        if k:
            q_stop.scatter_(-1, draft_tokens.gather(1, at[:, None]), 1.0)
    else:
        q_stop = draft_probs[rows, at] if k else torch.zeros_like(p_stop)
    # Position k has no draft: the bonus distribution is p itself.
    residual = torch.where(rejected[:, None], (p_stop - q_stop).clamp_min(0.0), p_stop)
    mass = residual.sum(-1, keepdim=True)
    # A rejection with zero residual mass can only happen through float round-off (p == q); fall back to p.
    residual = torch.where(mass > 0, residual, p_stop)
    return accept_len, sample(residual / residual.sum(-1, keepdim=True), generator)


def greedy_accept(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept while the draft equals the target's argmax; next token is the argmax after."""
    target = target_logits.argmax(-1)  # [N, k+1]
    k = draft_tokens.shape[1]
    accept_len = torch.cumprod((draft_tokens == target[:, :k]).to(torch.int64), dim=-1).sum(-1)
    return accept_len, target.gather(1, accept_len[:, None]).squeeze(1)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square goodness-of-fit p-value of token counts against probs (cells with an expected count
    below min_expected pooled); used to check that speculative sampling follows the target distribution."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < min_expected
    obs = torch.cat([counts.double()[~small], counts.double()[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    if obs[~keep].sum() > 0:
        return 0.0  # a token with zero probability was drawn
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor((len(obs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))
