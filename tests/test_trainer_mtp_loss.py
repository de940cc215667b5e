"""The fused, chunked MTP loss (trainer/mtp_loss.py): the value and the hidden-state gradient of the
full-logits cross-entropy, on trained targets only, padded and packed rows alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slime_spec.rollout.sample import Sample
from slime_spec.trainer import batch as B
from slime_spec.trainer import losses, mtp_loss, packing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_equals_full_logits_in_value_and_gradient(monkeypatch, dtype):
    monkeypatch.setattr(mtp_loss, "CHUNK_ELEMENTS", 3 * 24)  # 3 tokens per chunk: several chunks, one short
    torch.manual_seed(0)
    hidden = torch.randn(7, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(24, 16, dtype=dtype)  # rows 20..23: padded vocabulary, never a class
    targets = torch.tensor([0, 5, 19, 3, 3, 11, 7])
    upstream = torch.rand(7)
    ours = mtp_loss.linear_cross_entropy(hidden, weight, targets, vocab_size=20)
    (ours * upstream).sum().backward()
    ours_grad, hidden.grad = hidden.grad, None
    ref = F.cross_entropy((hidden @ weight.t())[:, :20].float(), targets, reduction="none")
    (ref * upstream).sum().backward()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours, ref, **tol)
    torch.testing.assert_close(ours_grad, hidden.grad, **tol)
    with torch.no_grad():  # no graph wanted: no gradient computed, same value
        torch.testing.assert_close(mtp_loss.linear_cross_entropy(hidden, weight, targets, 20), ours)


def test_weight_gets_no_gradient():
    hidden = torch.randn(3, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    mtp_loss.linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 3]), 10).sum().backward()
    assert weight.grad is None and hidden.grad is not None


def samples() -> list[Sample]:
    return [Sample(index=0, group_index=0, prompt="p", tokens=[5, 6, 7, 8, 9, 10], response_length=4,
                   loss_mask=[1, 0, 1, 1]),
            Sample(index=1, group_index=0, prompt="p", tokens=[11, 12, 13], response_length=2),
            Sample(index=2, group_index=0, prompt="p", tokens=[14, 15], response_length=1)]  # no MTP target


@pytest.mark.parametrize("packed", [False, True])
def test_mtp_loss_per_sample_equals_the_full_logits_loss(packed):
    torch.manual_seed(1)
    batch = B.collate(samples())
    rows = packing.model_rows(batch, packed)
    weight = torch.randn(32, 8)
    hidden = [torch.randn(rows.input_ids.shape[1], rows.input_ids.shape[0], 8, requires_grad=True)
              for _ in range(2)]  # [s, r, h] per MTP layer
    ours = mtp_loss.mtp_loss_per_sample(hidden, weight, rows, batch.loss_mask, vocab_size=30)
    ours.sum().backward()
    ours_grads = [h.grad for h in hidden]
    for h in hidden:
        h.grad = None
    logits = [(h @ weight.t()).transpose(0, 1)[..., :30] for h in hidden]
    targets = [rows.to_samples(ce) for ce in losses.mtp_target_losses(logits, rows.input_ids)]
    ref = losses.mtp_loss_from_targets(targets, batch.loss_mask)
    ref.sum().backward()
    torch.testing.assert_close(ours, ref)
    assert float(ours[2].detach()) == 0.0 and float(ours[0].detach()) > 0
    for got, want in zip(ours_grads, hidden):
        torch.testing.assert_close(got, want.grad)


def test_targets_are_trained_tokens_of_the_same_sample():
    rows = packing.packed_rows(B.collate(samples()))
    t = mtp_loss.mtp_targets(rows, B.collate(samples()).loss_mask, k=0)
    # sample 0 (row positions 0-5): trained targets are tokens 2, 4, 5 (loss_mask 1, 0, 1, 1 on 2..5);
    # sample 1 (6-8): token 2 (its response is tokens 1, 2; token 1 cannot be reached two ahead)
    assert t.token.tolist() == [7, 9, 10, 13] and (t.source + 2).tolist() == [2, 4, 5, 8]
    assert t.sample.tolist() == [0, 0, 0, 1] and t.per_sample.tolist() == [3.0, 1.0, 0.0]
