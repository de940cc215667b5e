"""Loss math, batching and checkpoint bookkeeping of the trainer (pure; no Megatron)."""

from __future__ import annotations

import pytest
import torch

from slime_spec.rollout.sample import Sample, Status
from slime_spec.trainer import batch, checkpoint, losses


def test_grpo_advantages_are_normalised_per_group():
    rewards = [1.0, 0.0, 0.0, 0.0, 5.0, 5.0]
    groups = [7, 7, 7, 3, 3, 3]
    adv = losses.grpo_advantages(rewards, groups, n_samples_per_prompt=3)
    g0 = torch.tensor([1.0, 0.0, 0.0])
    expected0 = (g0 - g0.mean()) / (g0.std() + 1e-6)  # unbiased std, as slime
    torch.testing.assert_close(adv[:3], expected0)
    g1 = torch.tensor([0.0, 5.0, 5.0])
    torch.testing.assert_close(adv[3:], (g1 - g1.mean()) / (g1.std() + 1e-6))
    assert abs(float(adv[:3].sum())) < 1e-5 and abs(float(adv[3:].sum())) < 1e-5
    same = losses.grpo_advantages([2.0, 2.0], [0, 0], n_samples_per_prompt=2)
    assert torch.equal(same, torch.zeros(2))  # equal rewards: no signal, no division blow-up
    unscaled = losses.grpo_advantages(rewards, groups, 3, std_normalize=False)
    torch.testing.assert_close(unscaled[:3], g0 - g0.mean())


def test_grpo_rejects_incomplete_groups():
    with pytest.raises(ValueError, match="n-samples-per-prompt"):
        losses.grpo_advantages([1.0, 0.0, 1.0], [0, 0, 1], n_samples_per_prompt=2)


def test_ppo_clip_loss_clips_only_in_the_direction_of_the_advantage():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = losses.ppo_clip_loss(new, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    # A > 0, ratio 1.5 -> capped at 1.28; A > 0, ratio 0.5 -> unclipped (min of objectives);
    # A < 0, ratio 1.5 -> unclipped; A < 0, ratio 0.5 -> capped at 0.8.
    torch.testing.assert_close(loss, torch.tensor([-1.28, -0.5, 1.5, 0.8]))
    assert clipped.tolist() == [1.0, 0.0, 0.0, 1.0]
    sym, _ = losses.ppo_clip_loss(new, old, adv, eps_clip=0.2)  # eps_clip_high defaults to eps_clip
    torch.testing.assert_close(sym[0], torch.tensor(-1.2))


def test_kl_estimators():
    lp = torch.log(torch.tensor([0.5, 0.2]))
    ref = torch.log(torch.tensor([0.25, 0.4]))
    r = lp - ref
    torch.testing.assert_close(losses.approx_kl(lp, ref, "k1"), r)
    torch.testing.assert_close(losses.approx_kl(lp, ref, "k2"), r ** 2 / 2)
    k3 = torch.exp(-r) - 1 + r
    torch.testing.assert_close(losses.approx_kl(lp, ref, "k3"), k3)
    torch.testing.assert_close(losses.approx_kl(lp, ref, "low_var_kl"), k3)
    assert bool((k3 >= 0).all())
    huge = losses.approx_kl(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl")
    assert float(huge) == 10.0  # clamped, as slime
    with pytest.raises(ValueError, match="kl-loss-type"):
        losses.approx_kl(lp, ref, "k9")


def test_log_probs_entropy_and_policy_terms_align_with_targets():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(1))
    lp = losses.token_log_probs(logits, ids)
    assert lp.shape == (2, 5) and float(lp[:, 0].abs().sum()) == 0.0
    manual = torch.log_softmax(logits[1, 2], -1)[ids[1, 3]]
    torch.testing.assert_close(lp[1, 3], manual)
    ent = losses.token_entropy(logits)
    p = torch.softmax(logits[0, 0], -1)
    torch.testing.assert_close(ent[0, 1], -(p * p.log()).sum())
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 0]], dtype=torch.float32)
    terms = losses.policy_loss_terms(lp, lp.detach(), torch.ones(2, 5), mask, eps_clip=0.2, eps_clip_high=None,
                                     entropy=ent, entropy_coef=0.01, ref_log_probs=lp.detach(), kl_loss_coef=1.0)
    torch.testing.assert_close(terms.pg_loss, torch.tensor([-1.0, -1.0]))  # ratio 1, advantage 1
    torch.testing.assert_close(terms.kl, torch.zeros(2))
    torch.testing.assert_close(terms.total, terms.pg_loss - 0.01 * terms.entropy)
    assert float(terms.entropy[1]) == pytest.approx(float(ent[1, 3]))  # only the masked token
    sft = losses.sft_loss_terms(lp, mask, ent)
    torch.testing.assert_close(sft.total[1], -lp[1, 3])


def test_log_probs_and_entropy_from_one_log_softmax_equal_the_two_apart():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(3))
    lp, ent = losses.token_log_probs_and_entropy(logits, ids)
    torch.testing.assert_close(lp, losses.token_log_probs(logits, ids))
    torch.testing.assert_close(ent, losses.token_entropy(logits))


def test_mtp_loss_targets_are_two_ahead_and_response_only():
    vocab, ids = 6, torch.tensor([[1, 2, 3, 4, 5]])
    logits = torch.full((1, 5, vocab), -20.0)
    for i in range(3):  # position i of MTP layer 0 predicts token i + 2, perfectly
        logits[0, i, ids[0, i + 2]] = 20.0
    mask = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0]])
    assert float(losses.mtp_loss_per_sample([logits], ids, mask)) < 1e-6
    wrong = logits.roll(1, dims=1)  # predicting one position late
    assert float(losses.mtp_loss_per_sample([wrong], ids, mask)) > 10
    (ce, m), = losses.mtp_token_losses([logits], ids, mask)
    assert ce.shape == (1, 3) and m.tolist() == [[0.0, 1.0, 1.0]]


def sample(index, group, prompt, response, **kw):
    return Sample(index=index, group_index=group, prompt="p", tokens=prompt + response,
                  response_length=len(response), **kw)


def test_collate_masks_and_pads():
    s0 = sample(0, 0, [5, 6], [7, 8, 9], loss_mask=[1, 0, 1], rollout_log_probs=[-1.0, -2.0, -3.0])
    s1 = sample(1, 0, [5], [7], status=Status.ABORTED)
    b = batch.collate([s0, s1])
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 0, 1], [0, 0, 0, 0, 0]]
    assert b.rollout_log_probs[0].tolist() == [0, 0, -1.0, -2.0, -3.0]
    assert b.has_rollout_log_probs.tolist() == [True, False]
    with pytest.raises(ValueError, match="loss_mask has 2 entries"):
        batch.collate([sample(0, 0, [5], [7, 8, 9], loss_mask=[1, 1])])


def test_step_slices_split_steps_ranks_and_micro_batches():
    assert batch.step_slices(8, 4, 1, dp_rank=1, dp_size=2) == [[[2], [3]], [[6], [7]]]
    assert batch.step_slices(4, 4, 2, dp_rank=0, dp_size=1) == [[[0, 1], [2, 3]]]
    with pytest.raises(ValueError, match="global-batch-size 3 must divide"):
        batch.step_slices(4, 3, 1, 0, 1)
    with pytest.raises(ValueError, match="micro-batch-size"):
        batch.step_slices(4, 4, 3, 0, 1)


def test_save_due_and_checkpoint_format(tmp_path):
    assert [r for r in range(6) if checkpoint.save_due(2, r)] == [1, 3, 5]
    assert checkpoint.save_due(4, 4, num_rollout=5) and not checkpoint.save_due(None, 3)
    state = {"decoder.final_layernorm.weight": torch.arange(3.0)}
    checkpoint.save_shard(tmp_path, 3, tp_rank=0, tp_size=1, hf_config={"x": 1}, model_state=state,
                          optimizer_state=None)
    checkpoint.mark_latest(tmp_path, 3)
    loaded = checkpoint.load_shard(tmp_path, tp_rank=0, tp_size=1)
    assert loaded["rollout_id"] == 3 and torch.equal(loaded["model"]["decoder.final_layernorm.weight"], state[
        "decoder.final_layernorm.weight"])
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1"):
        checkpoint.load_shard(tmp_path, tp_rank=0, tp_size=2)
    with pytest.raises(FileNotFoundError, match="latest_checkpointed_iteration"):
        checkpoint.load_shard(tmp_path / "nothing", 0, 1)
    assert len(list(tmp_path.glob("iter_*/*.pt"))) == 1


def test_log_probs_and_entropy_at_a_temperature_are_of_the_scaled_logits():
    logits, ids = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    lp, ent = losses.token_log_probs_and_entropy(logits, ids, temperature=0.5)
    assert torch.allclose(lp, losses.token_log_probs(logits * 2, ids))
    assert torch.allclose(ent, losses.token_entropy(logits * 2))
    assert torch.allclose(losses.token_log_probs(logits, ids, temperature=0.5), lp)
    assert torch.equal(losses.token_log_probs(logits, ids, temperature=1.0), losses.token_log_probs(logits, ids))


def test_tis_weights_each_tokens_policy_term_as_slime_does():
    """slime's vanilla TIS: w = clamp(exp(old - rollout), tis_clip_low, tis_clip) multiplies each token's pg term;
    the metrics are the weights before clipping, the clipped share and |w - 1|, averaged per sample."""
    torch.manual_seed(0)
    log_probs = torch.randn(2, 5, requires_grad=True)
    old = log_probs.detach() + 0.05 * torch.randn(2, 5)
    rollout = old + torch.tensor([[0.0, 1.0, -1.0, 0.2, 0.0], [2.0, -2.0, 0.0, 0.0, 0.1]])
    adv = torch.tensor([1.0, -1.0])[:, None].expand(2, 5)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.float32)
    kw = dict(eps_clip=0.2, eps_clip_high=0.28, entropy=torch.zeros(2, 5), entropy_coef=0.0)
    tis = losses.TisWeights(clip=2.0, clip_low=0.5)
    terms = losses.policy_loss_terms(log_probs, old, adv, mask, tis=tis, rollout_log_probs=rollout, **kw)
    raw = (old - rollout).exp()
    w = raw.clamp(0.5, 2.0)
    pg, _ = losses.ppo_clip_loss(log_probs, old, adv, 0.2, 0.28)
    assert torch.allclose(terms.pg_loss, losses.sample_mean(pg * w, mask))
    assert torch.allclose(terms.tis, losses.sample_mean(raw, mask))
    assert torch.allclose(terms.tis_clipfrac, losses.sample_mean((w != raw).float(), mask))
    assert float(terms.tis_clipfrac[0]) == pytest.approx(0.5) and float(terms.tis_clipfrac[1]) == 0.0
    assert torch.allclose(terms.tis_abs, losses.sample_mean((raw - 1).abs(), mask))
    terms.total.sum().backward()  # the weights carry no gradient: d pg / d log_probs is the PPO one, weighted
    expected = torch.autograd.grad(losses.sample_mean(pg * w.detach(), mask).sum(), log_probs)[0]
    assert torch.allclose(log_probs.grad, expected)
    plain = losses.policy_loss_terms(log_probs, old, adv, mask, **kw)
    assert plain.tis is None and not torch.allclose(plain.pg_loss, terms.pg_loss)
    same = losses.policy_loss_terms(log_probs, old, adv, mask, tis=tis, rollout_log_probs=old, **kw)
    assert torch.allclose(same.pg_loss, plain.pg_loss) and torch.allclose(same.tis, torch.ones(2))


def test_normalize_advantages_whitens_over_every_trained_token_as_slime_does():
    """slime's masked whitening of per-token advantages (mean over trained tokens, Bessel-corrected variance), on
    per-sample advantages that each count once per trained token; no trained token leaves them as they are."""
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    tokens = torch.tensor([3.0, 1.0, 2.0, 0.0])  # the last sample trains nothing (aborted or left out)
    per_token = torch.cat([a.repeat(int(n)) for a, n in zip(adv, tokens)])
    mean, var = per_token.mean(), per_token.var(unbiased=True)
    expected = (adv - mean) / torch.sqrt(var + 1e-8)
    out = losses.whiten_advantages(adv, tokens)
    assert torch.allclose(out, expected)
    whitened_tokens = torch.cat([a.repeat(int(n)) for a, n in zip(out, tokens)])
    assert float(whitened_tokens.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(whitened_tokens.std(unbiased=True)) == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(losses.whiten_advantages(adv, torch.zeros(4)), adv)


def test_dual_clip_bounds_a_negative_advantages_loss_as_slime_does():
    """--eps-clip-c: with a negative advantage the loss is at most -c * A however large the ratio; positive
    advantages and ratios inside the bound are untouched; the clip fraction counts the first clip only."""
    old = torch.zeros(1, 4)
    log_probs = torch.tensor([[3.0, 3.0, 0.1, -0.5]])  # ratios e^3 (far out), e^3, e^0.1, e^-0.5
    adv = torch.tensor([[-1.0, 1.0, -1.0, -1.0]])
    plain, clip_plain = losses.ppo_clip_loss(log_probs, old, adv, 0.2, 0.28)
    dual, clip_dual = losses.ppo_clip_loss(log_probs, old, adv, 0.2, 0.28, eps_clip_c=3.0)
    assert float(plain[0, 0]) == pytest.approx(2.718281828 ** 3) and float(dual[0, 0]) == pytest.approx(3.0)
    assert torch.equal(dual[0, 1:], plain[0, 1:]) and torch.equal(clip_dual, clip_plain)


def test_step_metrics_are_sample_means_or_token_means_under_per_token_loss():
    """train/* are means over the step's samples, or over its trained tokens with --calculate-per-token-loss (each
    sample's mean weighed by its tokens), as slime reduces its reported losses."""
    from slime_spec.trainer import step_metrics
    from slime_spec.trainer.batch import TokenBatch

    pg = torch.tensor([1.0, 4.0])
    terms = losses.LossTerms(total=pg, pg_loss=pg, kl=torch.zeros(2), entropy=torch.zeros(2),
                             clip_fraction=torch.zeros(2), mtp_loss=torch.zeros(2))
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])  # 1 and 3 trained tokens
    batch = TokenBatch(input_ids=torch.zeros(2, 4, dtype=torch.long), loss_mask=mask,
                       rollout_log_probs=torch.zeros(2, 4), has_rollout_log_probs=torch.zeros(2, dtype=torch.bool),
                       lengths=torch.tensor([4, 4]))
    for per_token, expected in ((False, (1.0 + 4.0) / 2), (True, (1.0 * 1 + 4.0 * 3) / 4)):
        sums = step_metrics.new_sums()
        step_metrics.accumulate(sums, terms, batch, None, per_token=per_token)
        metrics = step_metrics.step_metrics(sums, [], 1e-6, dp_size=1, device=torch.device("cpu"))
        assert metrics["pg_loss"] == pytest.approx(expected) and metrics["loss"] == pytest.approx(expected)
        assert "tis" not in metrics
