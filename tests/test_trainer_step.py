"""The in-process Trainer (what each TrainActor runs): GRPO / SFT steps, MTP training on and off, save/load."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from slime_spec.rollout.sample import Sample
from slime_spec.trainer.trainer import Trainer
from tests.helpers.trainers import random_rollout as rollout
from tests.helpers.trainers import tiny_mimo
from tests.helpers.trainers import train_config as config


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return tiny_mimo(tmp_path_factory.mktemp("mimo"))


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.clone() for n, p in trainer.named_megatron_params()}


def changed(before, trainer) -> dict[str, bool]:
    return {n: not torch.equal(before[n], p) for n, p in trainer.named_megatron_params()}


@pytest.mark.parametrize("enable_mtp_training", [False, True])
def test_grpo_step_moves_policy_and_mtp_only_when_enabled(mimo, enable_mtp_training):
    trainer = Trainer(config(mimo, enable_mtp_training=enable_mtp_training, use_kl_loss=True, kl_loss_coef=0.1))
    samples = rollout()
    probe = [samples[1].tokens]
    before, logits_before = snapshot(trainer), trainer.forward_logits(probe)
    metrics = trainer.train_step(samples, rollout_id=0)
    for key in ("loss", "pg_loss", "kl", "clip_fraction", "entropy", "grad_norm", "mtp_loss", "lr"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    assert metrics["grad_norm"] > 0 and metrics["lr"] == 1e-3 and metrics["mtp_loss"] > 0
    diff = changed(before, trainer)
    assert all(v for n, v in diff.items() if not n.startswith("mtp.")), diff
    assert all(v == enable_mtp_training for n, v in diff.items() if n.startswith("mtp.")), diff
    after = trainer.forward_logits(probe)
    assert not torch.allclose(after["logits"], logits_before["logits"])


def test_grpo_raises_log_prob_of_rewarded_response_and_mtp_loss_falls(mimo):
    trainer = Trainer(config(mimo, enable_mtp_training=True, global_batch_size=4))
    samples = rollout(n_prompts=2, n=2, seed=3)
    good, bad = samples[1], samples[0]  # reward 1 vs 0 in the same group

    def response_log_prob(s):
        from slime_spec.trainer.losses import token_log_probs
        logits = trainer.forward_logits([s.tokens])["logits"]
        return float(token_log_probs(logits, torch.tensor([s.tokens]))[0, -s.response_length:].sum())

    good0, bad0 = response_log_prob(good), response_log_prob(bad)
    mtp_losses = [trainer.train_step(samples, rollout_id=r)["mtp_loss"] for r in range(3)]
    assert response_log_prob(good) > good0 and response_log_prob(bad) < bad0
    assert mtp_losses[-1] < mtp_losses[0]


def test_sft_step_lowers_nll(mimo):
    trainer = Trainer(config(mimo, loss_type="sft", enable_mtp_training=True, global_batch_size=4))
    samples = rollout(seed=5)
    for s in samples:
        s.reward = None  # SFT needs no reward
    first = trainer.train_step(samples, 0)
    second = trainer.sft_step(samples, 1)  # the warm-up entry point: SFT whatever --loss-type
    assert second["loss"] < first["loss"] and second["mtp_loss"] < first["mtp_loss"]
    assert first["clip_fraction"] == 0.0


def test_save_then_load_restores_weights_and_optimizer(mimo, tmp_path):
    trainer = Trainer(config(mimo, enable_mtp_training=True, save=str(tmp_path), save_interval=1))
    trainer.train_step(rollout(), 0)
    trainer.save(0)
    resumed = Trainer(config(mimo, enable_mtp_training=True, load=str(tmp_path)))
    assert resumed.start_rollout_id == 1
    saved = dict(trainer.named_megatron_params())
    assert all(torch.equal(saved[n], p) for n, p in resumed.named_megatron_params())
    # Same optimizer state => the same next step.
    m1, m2 = trainer.train_step(rollout(seed=9), 1), resumed.train_step(rollout(seed=9), 1)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for (_, a), (_, b) in
               zip(trainer.named_megatron_params(), resumed.named_megatron_params()))


def test_bad_inputs_are_clear_errors(mimo):
    trainer = Trainer(config(mimo))
    samples = rollout()
    samples[2].reward = None
    with pytest.raises(ValueError, match="sample 2 has no reward"):
        trainer.train_step(samples, 0)
    with pytest.raises(ValueError, match="global-batch-size 2 must divide"):
        trainer.train_step(rollout()[:3], 0)
    with pytest.raises(ValueError, match="kl-loss-type"):
        Trainer(config(mimo, use_kl_loss=True, kl_loss_type="k7"))


def _generate(engine, prompts: list[list[int]], n: int, temperature: float, max_new_tokens: int) -> list:
    from slime_spec.engine.managers.engine_core import Request, SamplingParams
    for i, p in enumerate(prompts):
        for j in range(n):
            engine.add_request(Request(f"{i}-{j}", p, SamplingParams(temperature=temperature, ignore_eos=True,
                                                                     max_new_tokens=max_new_tokens)))
    outs = []
    while engine.has_work():
        outs += engine.step()
    return sorted(outs, key=lambda o: tuple(map(int, o.rid.split("-"))))


def _accept_length(engine, prompts) -> float:
    outs = _generate(engine, prompts, 1, 0.0, 24)
    return sum(o.completion_tokens for o in outs) / sum(o.spec_verify_ct for o in outs)


def test_online_mtp_training_raises_acceptance_on_the_policys_own_outputs(mimo):
    """The loop in miniature, twice: engine rollout -> GRPO step -> sync (target + MTP) into the engine.
    With --enable-mtp-training the draft learns the policy's own outputs and acceptance rises; a frozen
    draft stays where it was."""
    from slime_spec.engine.managers.engine_core import EngineCore, SpecConfig
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 100) for _ in range(6)] for _ in range(4)]
    accept = {}
    for enable in (True, False):
        engine = EngineCore(str(mimo), SpecConfig("NEXTN", speculative_num_steps=3, speculative_eagle_topk=1,
                                                speculative_num_draft_tokens=4), seed=0)
        trainer = Trainer(config(mimo, enable_mtp_training=enable, global_batch_size=16, micro_batch_size=16,
                                 n_samples_per_prompt=4, lr=3e-3, mtp_loss_scaling_factor=1.0))
        start = _accept_length(engine, prompts)
        for step in range(8):
            outs = _generate(engine, prompts, 4, 1.0, 16)
            samples = [Sample(index=k, group_index=k // 4, prompt="p", tokens=prompts[k // 4] + o.output_ids,
                              response_length=len(o.output_ids), reward=float(o.output_ids[0] % 2))
                       for k, o in enumerate(outs)]
            trainer.train_step(samples, rollout_id=step)
            engine.load_weights(list(trainer.hf_state_dict().items()), selector="all")
        accept[enable] = (start, _accept_length(engine, prompts))
    (start_t, end_t), (start_f, end_f) = accept[True], accept[False]
    assert start_t == start_f  # same checkpoint, same prompts, greedy
    assert end_t > start_t + 0.15 and end_t > end_f + 0.15, accept


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_log_probs_are_of_the_rollout_temperatures_distribution(mimo, temperature):
    """SGLang returns log-probs of the temperature-scaled distribution it sampled from; the trainer's old
    log-probs must be of that distribution too, or the importance ratio is off from the first step."""
    samples = rollout(n_prompts=1, n=2, seed=5)
    probe = Trainer(config(mimo))
    for s in samples:
        logits = probe.forward_logits([s.tokens])["logits"]
        scaled = torch.log_softmax(logits[0, :-1].float() / temperature, dim=-1)
        picked = scaled.gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
        s.rollout_log_probs = picked[-s.response_length:].tolist()
    at_temperature = Trainer(config(mimo, rollout_temperature=temperature)).train_step(samples, rollout_id=0)
    at_one = Trainer(config(mimo)).train_step(samples, rollout_id=0)
    assert at_temperature["train_rollout_logprob_abs_diff"] < 1e-4
    if temperature != 1.0:
        assert at_one["train_rollout_logprob_abs_diff"] > 1e-2


def test_tis_reports_slimes_metrics_and_refuses_samples_without_rollout_log_probs(mimo):
    """--use-tis: rollout log-probs equal to the trainer's old ones weigh every token 1 (the step is the one without
    TIS); others move it, and train/tis* are reported. A sample without them is a clear error naming the flag."""
    samples = rollout(seed=5)
    old = Trainer(config(mimo)).forward_logits([s.tokens for s in samples])["logits"]
    from slime_spec.trainer.losses import token_log_probs
    for s, logits in zip(samples, old):
        lp = token_log_probs(logits[None, :len(s.tokens)], torch.tensor([s.tokens]))[0]
        s.rollout_log_probs = lp[-s.response_length:].tolist()
    plain = Trainer(config(mimo)).train_step(samples, rollout_id=0)
    with_tis = Trainer(config(mimo, use_tis=True)).train_step(samples, rollout_id=0)
    assert "tis" not in plain and with_tis["tis"] == pytest.approx(1.0, abs=1e-4)
    assert with_tis["tis_clipfrac"] == 0.0 and with_tis["tis_abs"] < 1e-4
    assert with_tis["pg_loss"] == pytest.approx(plain["pg_loss"], abs=1e-5)
    for s in samples:
        s.rollout_log_probs = [v - 0.5 for v in s.rollout_log_probs]  # the engine was less sure: weights e^0.5
    shifted = Trainer(config(mimo, use_tis=True, tis_clip=1.5)).train_step(samples, rollout_id=0)
    assert shifted["tis"] == pytest.approx(2.718 ** 0.5, rel=1e-3) and shifted["tis_clipfrac"] == 1.0
    samples[2].rollout_log_probs = []
    with pytest.raises(ValueError, match="--use-tis .* sample 2"):
        Trainer(config(mimo, use_tis=True)).train_step(samples, rollout_id=0)


def test_use_rollout_logprobs_takes_the_engines_log_probs_as_the_old_policys(mimo, monkeypatch):
    """--use-rollout-logprobs (slime's): the importance ratios are against the rollout's log-probs and no old-policy
    forward runs; equal to the trainer's own, the step is the default one. train_rollout_logprob_abs_diff compares
    this forward's log-probs with the rollout's, as slime's. A sample without them is a clear error naming the flag."""
    from slime_spec.trainer.losses import token_log_probs
    samples = rollout(seed=5)
    old = Trainer(config(mimo)).forward_logits([s.tokens for s in samples])["logits"]
    for s, logits in zip(samples, old):
        s.rollout_log_probs = token_log_probs(logits[None, :len(s.tokens)], torch.tensor([s.tokens]))[0][
            -s.response_length:].tolist()
    plain = Trainer(config(mimo, global_batch_size=4)).train_step(samples, rollout_id=0)

    def without_old_forward():  # one optimizer step: this forward's log-probs are the policy's before the update
        trainer = Trainer(config(mimo, use_rollout_logprobs=True, global_batch_size=4))
        monkeypatch.setattr(trainer, "_log_probs", lambda batch: pytest.fail("an old-policy forward ran"))
        return trainer

    same = without_old_forward().train_step(samples, rollout_id=0)
    assert same["pg_loss"] == pytest.approx(plain["pg_loss"], abs=1e-5) and same["clip_fraction"] == 0.0
    assert same["train_rollout_logprob_abs_diff"] < 1e-4
    for s in samples:
        s.rollout_log_probs = [v - 0.5 for v in s.rollout_log_probs]  # ratios e^0.5: past the clip range
    shifted = without_old_forward().train_step(samples, rollout_id=0)
    assert shifted["clip_fraction"] > 0.0 and shifted["train_rollout_logprob_abs_diff"] == pytest.approx(0.5, abs=1e-4)
    samples[2].rollout_log_probs = []
    with pytest.raises(ValueError, match="--use-rollout-logprobs .* sample 2"):
        without_old_forward().train_step(samples, rollout_id=0)


def test_calculate_per_token_loss_weighs_every_token_of_the_step_alike(mimo):
    """--calculate-per-token-loss (slime's): the step's loss is the mean over its trained tokens, not over its
    samples. At the first update the policy gradient is linear in the advantages, so with raw rewards as advantages
    (--disable-rewards-normalization) it equals the per-sample gradient with each reward scaled by its sample's
    tokens x samples / the step's tokens. Samples of one length give the per-sample step itself."""
    lengths = [1, 2, 3, 5]
    samples = [Sample(index=i, group_index=i // 2, prompt="p", tokens=[5, 6, 7] + [10 + i] * n, response_length=n,
                      reward=[0.5, -1.0, 2.0, 0.25][i]) for i, n in enumerate(lengths)]
    base = dict(global_batch_size=4, micro_batch_size=2, mtp_num_layers=0, disable_rewards_normalization=True)
    per_token = Trainer(config(mimo, calculate_per_token_loss=True, **base)).gradients(samples)
    scaled = [dataclasses.replace(s, reward=s.reward * n * len(lengths) / sum(lengths))
              for s, n in zip(samples, lengths)]
    per_sample = Trainer(config(mimo, **base)).gradients(scaled)
    assert set(per_token) == set(per_sample)
    for name in per_token:
        torch.testing.assert_close(per_token[name], per_sample[name], atol=1e-6, rtol=1e-4, msg=name)
    alike = [dataclasses.replace(s, tokens=[5, 6, 7, 10, 11], response_length=2) for s in samples]
    same = Trainer(config(mimo, calculate_per_token_loss=True, **base)).gradients(alike)
    plain = Trainer(config(mimo, **base)).gradients(alike)
    assert all(torch.allclose(same[n], plain[n], atol=1e-7, rtol=1e-5) for n in same)
    unweighted = Trainer(config(mimo, **base)).gradients(samples)
    assert not all(torch.allclose(per_token[n], unweighted[n], atol=1e-6) for n in per_token)  # lengths apart


def test_normalize_advantages_whitens_the_rollouts_grpo_advantages(mimo):
    """--normalize-advantages: GRPO's per-group advantages, whitened over every trained token of the rollout (each
    rank holds the whole rollout: slime's statistics over its data-parallel group)."""
    from slime_spec.trainer.finite_guard import grpo_advantages_without
    from slime_spec.trainer.losses import whiten_advantages
    samples = rollout(n_prompts=2, n=2, seed=7, reward_of=lambda j: [0.0, 1.0][j])
    samples[3].response_length, samples[3].tokens = 2, samples[3].tokens[:-4]  # unequal lengths weigh differently
    grpo = grpo_advantages_without([s.reward for s in samples], [s.group_index for s in samples], 2, [False] * 4)
    prepared = Trainer(config(mimo, normalize_advantages=True))._prepare(samples, None)
    expected = whiten_advantages(grpo, torch.tensor([float(s.response_length) for s in samples]))
    assert torch.allclose(prepared.advantages, expected) and not torch.allclose(expected, grpo)
    assert Trainer(config(mimo))._prepare(samples, None).advantages.tolist() == grpo.tolist()


def test_reward_normalization_flags_follow_slimes_reward_post_processing(mimo):
    """--disable-grpo-std-normalization centres each group's rewards on its mean only (Dr. GRPO);
    --disable-rewards-normalization trains on the raw rewards; a left-out sample's advantage stays 0."""
    from slime_spec.trainer.finite_guard import grpo_advantages_without
    rewards, groups = [1.0, 0.0, 3.0, 4.0, 2.0, 2.0], [0, 0, 0, 1, 1, 1]
    left_out = [False, False, False, False, False, True]
    assert grpo_advantages_without(rewards, groups, 3, left_out, std_normalization=False).tolist() == \
        pytest.approx([-1 / 3, -4 / 3, 5 / 3, 1.0, -1.0, 0.0])
    assert grpo_advantages_without(rewards, groups, 3, left_out, rewards_normalization=False).tolist() == \
        [1.0, 0.0, 3.0, 4.0, 2.0, 0.0]
    samples = rollout(n_prompts=2, n=2, seed=7, reward_of=lambda j: [0.0, 3.0][j])
    raw = Trainer(config(mimo, disable_rewards_normalization=True))._prepare(samples, None).advantages
    centred = Trainer(config(mimo, disable_grpo_std_normalization=True))._prepare(samples, None).advantages
    assert raw.tolist() == [0.0, 3.0, 0.0, 3.0] and centred.tolist() == [-1.5, 1.5, -1.5, 1.5]
