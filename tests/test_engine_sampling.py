"""Sampling filters as SGLang applies them, and speculative acceptance that preserves the target distribution."""

import contextlib

import pytest
import torch

from slime_spec.engine.managers.request import SamplingParams
from slime_spec.engine.model_executor import sampling
from slime_spec.engine.model_executor.sampling import chi_square_pvalue

# Greedy (temperature 0, and top_k 1 with its filter) and sampled rows, with top-p, top-k and min-p on some rows.
MIXED = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=1.0),
         SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=1.3, top_k=5, min_p=0.05),
         SamplingParams(temperature=0.5, min_p=0.2)]


@contextlib.contextmanager
def no_device_reads(monkeypatch):
    """Fail on what waits for the stream on CUDA: a boolean mask as an index (the selected row count is read back),
    a Python number written at tensor indices (index_put_ copies it to the device, synchronously) and bool() /
    item() / tolist() of a tensor. On CPU nothing waits, so this is how a CPU test pins it."""
    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def check(index, value=None) -> None:
        for i in index if isinstance(index, tuple) else (index,):
            assert not (isinstance(i, torch.Tensor) and i.dtype == torch.bool), "boolean-mask indexing"
            assert not (isinstance(i, torch.Tensor) and isinstance(value, (int, float))), "a number put at indices"

    def read(self, *args, **kwargs):
        raise AssertionError("a read of device values")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "__getitem__", lambda self, index: check(index) or getitem(self, index))
        m.setattr(torch.Tensor, "__setitem__",
                  lambda self, index, value: check(index, value) or setitem(self, index, value))
        for name in ("__bool__", "item", "tolist"):
            m.setattr(torch.Tensor, name, read)
        yield


def mask_reference(logits, temps, top_ks, top_ps, min_ps):
    """SGLang's filters with the filtered rows picked by boolean masks (which wait for the stream on CUDA): what
    filtered_probs computes, bit for bit, from what the host knows (a plain softmax when no row filters)."""
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    rows = (top_ks < probs.shape[-1]) | (top_ps < 1.0)
    if not (rows.any() or (min_ps > 0).any()):
        return probs
    probs[rows] = sampling._top_k_top_p(probs[rows], top_ks[rows], top_ps[rows])
    if (min_ps > 0).any():
        probs = probs.masked_fill(probs < probs.amax(-1, keepdim=True) * min_ps[:, None], 0.0)
    return probs / probs.sum(-1, keepdim=True)


def test_filters_mirror_sglang_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 4))
    temps = torch.ones(4)
    top_k = torch.tensor([5, 2, 5, 5])
    top_p = torch.tensor([1.0, 1.0, 0.6, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.3])
    probs = sampling.filtered_probs(logits, temps, top_k, top_p, min_p)
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    torch.testing.assert_close(probs[1], torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    # top_p keeps a token while the mass before it is <= top_p: 0.5 and 0.2 (0.5 <= 0.6), not 0.15 (0.7 > 0.6).
    torch.testing.assert_close(probs[2], torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    # min_p drops tokens below 0.3 * 0.5 = 0.15 (0.15 itself stays).
    torch.testing.assert_close(probs[3], torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    hot = sampling.filtered_probs(logits[:1], torch.tensor([2.0]), top_k[:1], top_p[:1], min_p[:1])
    torch.testing.assert_close(hot[0], torch.softmax(logits[0] / 2, -1))


def test_logprobs_follow_sglang_default():
    logits = torch.randn(3, 10)
    greedy = torch.tensor([True, False, False])
    temps = torch.tensor([0.0, 0.5, 1.0])
    lp = sampling.output_logprobs(logits, temps, greedy)
    torch.testing.assert_close(lp[0], torch.log_softmax(logits[0], -1))
    torch.testing.assert_close(lp[1], torch.log_softmax(logits[1] / 0.5, -1))
    assert sampling.is_greedy(0.0, -1) and sampling.is_greedy(0.7, 1) and not sampling.is_greedy(0.7, -1)


def test_greedy_accept():
    logits = torch.full((2, 4, 6), -1.0)
    for row, seq in enumerate([[1, 2, 3, 4], [1, 5, 3, 0]]):
        for j, t in enumerate(seq):
            logits[row, j, t] = 1.0
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3]])
    accept, nxt = sampling.greedy_accept(logits, drafts)
    assert accept.tolist() == [3, 1] and nxt.tolist() == [4, 5]


def _first_token_of_verify(p, q, deterministic, n, gen):
    """Draft one token from q per row, verify against p; return the first emitted token per row."""
    V = p.shape[-1]
    drafts = torch.multinomial(q.expand(n, V), 1, replacement=True, generator=gen)
    target = p.expand(n, 2, V).clone()
    draft_probs = None if deterministic else q.expand(n, 1, V)
    accept, nxt = sampling.speculative_accept(target, draft_probs, drafts, gen)
    return torch.where(accept > 0, drafts[:, 0], nxt)


def test_speculative_sampling_follows_target_distribution():
    gen = torch.Generator().manual_seed(0)
    V, n = 8, 40000
    p = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    for deterministic in (False, True):
        out = _first_token_of_verify(p, q, deterministic, n, gen)
        assert chi_square_pvalue(torch.bincount(out, minlength=V), p) > 1e-3
    # A deterministic draft (q one-hot): acceptance p(x), residual p without x.
    onehot = torch.zeros(V)
    onehot[2] = 1.0
    out = _first_token_of_verify(p, onehot, True, n, gen)
    assert chi_square_pvalue(torch.bincount(out, minlength=V), p) > 1e-3
    # Power check: the wrong rule "on rejection resample from p" is biased towards the draft and is detected.
    drafts = torch.full((n, 1), 2)
    u = torch.rand(n, generator=gen)
    naive = torch.where(u < p[2], drafts[:, 0], torch.multinomial(p.expand(n, V), 1, generator=gen)[:, 0])
    assert chi_square_pvalue(torch.bincount(naive, minlength=V), p) < 1e-6


def test_speculative_chain_joint_distribution():
    """Two draft tokens: the pair of emitted tokens follows p(x1) p(x2 | x1) when every position has its own p."""
    gen = torch.Generator().manual_seed(1)
    V, n = 4, 60000
    p1 = torch.softmax(torch.randn(V, generator=gen), -1)
    p2 = torch.softmax(torch.randn(V, V, generator=gen), -1)  # p2[x1] = next distribution after x1
    drafts = torch.stack([torch.full((n,), 1), torch.full((n,), 3)], dim=1)
    target = torch.stack([p1.expand(n, V), p2[1].expand(n, V), p2[1].expand(n, V)], dim=1)  # last: unused bonus
    accept, nxt = sampling.speculative_accept(target, None, drafts, gen)
    first = torch.where(accept > 0, drafts[:, 0], nxt)
    # The second token is only determined by this verify when the first draft was accepted (x1 == 1).
    second = torch.where(accept > 1, drafts[:, 1], nxt)[accept > 0]
    assert chi_square_pvalue(torch.bincount(first, minlength=V), p1) > 1e-3
    assert chi_square_pvalue(torch.bincount(second, minlength=V), p2[1]) > 1e-3


def _sorted_reference(logits, temps, top_ks, top_ps, min_ps):
    """SGLang's filter on every row through the sorted path (what filtered_probs skips when no filter is on)."""
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    ranks = torch.arange(probs.shape[-1])[None, :]
    probs_sort = probs_sort.masked_fill(ranks >= top_ks[:, None], 0.0)
    probs_sort = probs_sort.masked_fill((probs_sum - probs_sort) > top_ps[:, None], 0.0)
    probs_sort = probs_sort.masked_fill(probs_sort < (probs_sort[:, :1] * min_ps[:, None]), 0.0)
    out = torch.zeros_like(probs).scatter_(-1, probs_idx, probs_sort)
    return out / out.sum(-1, keepdim=True)


def test_unfiltered_rows_skip_the_sort_and_agree_with_it():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen) * 3
    temps = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 1.0])
    top_ks = torch.tensor([50, 50, 5, 50, 3, 60])
    top_ps = torch.tensor([1.0, 1.0, 1.0, 0.8, 0.9, 1.0])
    min_ps = torch.tensor([0.0, 0.1, 0.0, 0.0, 0.05, 0.2])
    torch.testing.assert_close(sampling.filtered_probs(logits, temps, top_ks, top_ps, min_ps),
                               _sorted_reference(logits, temps, top_ks, top_ps, min_ps))


def test_sample_follows_probs_and_token_logprobs_match_the_full_log_softmax():
    gen = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(12, generator=gen) * 2, -1)
    draws = sampling.sample(p.expand(40000, 12).contiguous(), gen)
    assert chi_square_pvalue(torch.bincount(draws, minlength=12), p) > 1e-3
    biased = torch.softmax(torch.log(p) * 1.1, -1)  # power: a slightly sharper distribution is detected
    assert chi_square_pvalue(torch.bincount(sampling.sample(biased.expand(40000, 12).contiguous(), gen),
                                            minlength=12), p) < 1e-6
    logits, temps, greedy = torch.randn(5, 30), torch.tensor([0.0, 0.5, 1.0, 2.0, 1.0]), \
        torch.tensor([True, False, False, False, False])
    tokens = torch.tensor([3, 0, 29, 7, 7])
    full = sampling.output_logprobs(logits, temps, greedy).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(sampling.token_logprobs(logits, temps, greedy, tokens), full)


def test_sampled_drafts_verified_with_q_follow_p_and_a_biased_rule_is_caught():
    """Drafts sampled from q, verified with q (min(1, p/q), residual max(0, p - q)) follow p. Verifying them as if
    greedy (q one-hot) is lossless too, only less accepted. The rule "accept with min(1, p/q), on rejection
    resample from p" is biased and detected."""
    gen = torch.Generator().manual_seed(5)
    V, n = 8, 40000
    p = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    drafts = torch.multinomial(q.expand(n, V), 1, replacement=True, generator=gen)
    target = p.expand(n, 2, V).clone()
    rates = []
    for draft_probs in (q.expand(n, 1, V), None):
        accept, nxt = sampling.speculative_accept(target, draft_probs, drafts, gen)
        first = torch.where(accept > 0, drafts[:, 0], nxt)
        assert chi_square_pvalue(torch.bincount(first, minlength=V), p) > 1e-3
        rates.append(float((accept > 0).float().mean()))
    assert rates[0] > rates[1]  # knowing q accepts more
    ratio = (p[drafts[:, 0]] / q[drafts[:, 0]]).clamp_max(1.0)
    keep = torch.rand(n, generator=gen) < ratio
    biased = torch.where(keep, drafts[:, 0], torch.multinomial(p.expand(n, V), 1, generator=gen)[:, 0])
    assert chi_square_pvalue(torch.bincount(biased, minlength=V), p) < 1e-6


def test_batch_params_know_on_the_host_which_rows_sample_and_filter():
    p = sampling.batch_params(MIXED, 50, "cpu")
    assert p.greedy.tolist() == [True, False, False, True, False, False] and p.sampled.tolist() == [1, 2, 4, 5]
    assert not p.all_greedy and not p.all_sampled and p.sorting.tolist() == [0, 2] and p.min_p
    for column, values in zip(p.sampled_params, (p.temps, p.top_ks, p.top_ps, p.min_ps)):
        assert torch.equal(column, values[[1, 2, 4, 5]])
    assert p.top_ks.tolist() == [50, 50, 50, 1, 5, 50]
    # Only the sampled rows' filters count: a greedy row's top_p takes no sampled row through the sort.
    plain = sampling.batch_params([SamplingParams(temperature=0.0, top_p=0.5), SamplingParams()], 50, "cpu")
    assert plain.sampled.tolist() == [1] and plain.sorting.numel() == 0 and not plain.min_p
    every = sampling.batch_params([SamplingParams(top_k=60), SamplingParams(top_k=50), SamplingParams(top_k=3)],
                                  50, "cpu")
    assert every.all_sampled and every.sampled.tolist() == [0, 1, 2] and every.sorting.tolist() == [2]
    assert sampling.batch_params([SamplingParams(temperature=0.0)] * 2, 50, "cpu").all_greedy


def test_sampled_probs_read_nothing_back_and_equal_the_masked_filters(monkeypatch):
    """The sampled rows' filtered distribution from host flags and row indices: no boolean mask, no read of the
    device, and bitwise what picking the filtered rows by boolean masks gives."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 50, generator=gen) * 3
    per_position = torch.randn(6, 3, 50, generator=gen) * 3
    for params in (MIXED, MIXED[1:3], MIXED[4:], [MIXED[1], MIXED[4]], [MIXED[0], MIXED[2]]):
        p = sampling.batch_params(params, 50, "cpu")
        with no_device_reads(monkeypatch):
            probs = p.sampled_probs(p.of_sampled(logits[: len(params)]))
            chained = p.sampled_probs(p.of_sampled(per_position[: len(params)]).flatten(0, 1), reps=3)
        sampled = ~p.greedy
        ref = mask_reference(logits[: len(params)][sampled], p.temps[sampled], p.top_ks[sampled],
                             p.top_ps[sampled], p.min_ps[sampled])
        assert torch.equal(probs, ref)
        reps = [t[sampled].repeat_interleave(3) for t in (p.temps, p.top_ks, p.top_ps, p.min_ps)]
        assert torch.equal(chained, mask_reference(per_position[: len(params)][sampled].flatten(0, 1), *reps))
    with pytest.raises(AssertionError, match="boolean-mask"), no_device_reads(monkeypatch):
        logits[p.greedy]  # the guard itself catches what it is meant to


def test_a_deterministic_draft_is_verified_as_its_one_hot_q_without_device_reads(monkeypatch):
    """q None (greedy drafts, NGRAM) means q one-hot at each drafted token: the same acceptance and residual
    tokens, bit for bit, as passing that q, built without writing a number at indices (a host-to-device copy)."""
    gen = torch.Generator().manual_seed(7)
    target = torch.softmax(torch.randn(5, 4, 12, generator=gen), -1)
    drafts = torch.randint(12, (5, 3), generator=gen)
    one_hot = torch.nn.functional.one_hot(drafts, 12).float()
    with no_device_reads(monkeypatch):
        accept, token = sampling.speculative_accept(target, None, drafts, torch.Generator().manual_seed(1))
    ref_accept, ref_token = sampling.speculative_accept(target, one_hot, drafts, torch.Generator().manual_seed(1))
    assert torch.equal(accept, ref_accept) and torch.equal(token, ref_token)
