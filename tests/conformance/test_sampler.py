"""The eager sampler's filters (`engine/model_executor/sampling.filtered_probs`) against SGLang's own
`top_k_top_p_min_p_sampling_from_probs_torch` (sglang/srt/layers/sampler.py, its `pytorch` sampling backend), run
on the same probabilities: the filtered distribution it samples from equals ours, row by row. (The sampling kernel
serves only unfiltered rows, where both are softmax(logits / T): tests/test_sampling_kernel.py.)"""

from __future__ import annotations

import pytest
import torch

from slime_spec.engine.model_executor import sampling
from tests.conformance.sglang_doubles import install


@pytest.fixture(scope="module")
def sglang_filter():
    install()
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch
    return top_k_top_p_min_p_sampling_from_probs_torch


def sglang_filtered_probs(sglang_filter, logits, temps, top_ks, top_ps, min_ps) -> torch.Tensor:
    """What SGLang's standard sampling path samples from: softmax(logits / T) (its `logits.div_(temperatures)`, then
    softmax), filtered by its function, whose filtered weights come back sorted with their token ids."""
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    _, weights, ids, _ = sglang_filter(probs.clone(), top_ks, top_ps, min_ps, bool((min_ps > 0).any()), None,
                                       torch.zeros(len(probs), dtype=torch.long), return_filtered_probs=True)
    out = torch.zeros_like(probs).scatter_(-1, ids.long(), weights)
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize("min_p", [False, True])
def test_filtered_probs_equal_sglangs_filter(sglang_filter, min_p):
    g = torch.Generator().manual_seed(0)
    rows, vocab = 8, 64
    logits = torch.randn(rows, vocab, generator=g)  # flat enough that every filter removes tokens
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 2.0, 1.0])
    top_ks = torch.tensor([vocab, 5, vocab, 1, 20, 3, vocab, 40])
    top_ps = torch.tensor([1.0, 1.0, 0.8, 1.0, 0.9, 0.5, 0.95, 1.0])
    min_ps = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.2, 0.1]) if min_p else torch.zeros(rows)
    ours = sampling.filtered_probs(logits, temps, top_ks, top_ps, min_ps)
    theirs = sglang_filtered_probs(sglang_filter, logits, temps, top_ks, top_ps, min_ps)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    assert ((ours > 0) == (theirs > 0)).all()  # the same tokens kept, not merely close mass
