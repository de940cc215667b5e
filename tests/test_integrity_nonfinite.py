"""No non-finite value reaches the weights, the engines or the checkpoints (trainer/finite_guard.py, Trainer).

A non-finite or failed reward leaves its sample out (its group's advantage computed without it); a step whose
loss or gradient norm is not finite is skipped and counted, and the run stops after
--max-consecutive-skipped-steps of them; weights are checked before every save and sync.
"""

from __future__ import annotations

import math

import pytest
import torch

from slime_spec.rollout.reward_runner import record_failure
from slime_spec.rollout.sample import Sample
from slime_spec.trainer import losses
from slime_spec.trainer import trainer as trainer_module
from slime_spec.trainer.actor import TrainActor
from slime_spec.trainer.finite_guard import NonFiniteError, SkipTracker, grpo_advantages_without
from slime_spec.trainer.trainer import Trainer
from tests.helpers.trainers import random_rollout, tiny_mimo, train_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_mimo(tmp_path_factory.mktemp("mimo"))


def rollout() -> list[Sample]:
    return random_rollout(n=3, reward_of=lambda j: float(j % 2))


def make_trainer(path, **kw) -> Trainer:
    return Trainer(train_config(path, **{"global_batch_size": 6, "micro_batch_size": 2, "n_samples_per_prompt": 3,
                                         **kw}))


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.named_megatron_params()}


def all_finite(trainer: Trainer) -> bool:
    return all(bool(torch.isfinite(p).all()) for _, p in trainer.named_megatron_params())


def test_group_advantage_computed_without_the_left_out_sample():
    adv = grpo_advantages_without([1.0, float("nan"), 0.0, 3.0, 1.0, 2.0], [0, 0, 0, 1, 1, 1], 3,
                                  [False, True, False, False, False, False])
    assert torch.allclose(adv[[0, 2]], losses.grpo_advantages([1.0, 0.0], [0, 0], 2))
    assert adv[1] == 0.0
    assert torch.allclose(adv[3:], losses.grpo_advantages([3.0, 1.0, 2.0], [1, 1, 1], 3))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), "raised"])
def test_nonfinite_or_failed_reward_is_left_out_and_weights_stay_finite(model, bad):
    trainer = make_trainer(model)
    samples = rollout()
    if bad == "raised":
        samples[1].reward = None
        record_failure(samples[1], "error", "ValueError: boom")
    else:
        samples[1].reward = bad
    before = params(trainer)
    metrics = trainer.train_step(samples, rollout_id=0)
    assert metrics["reward_left_out"] == 1 and metrics["skipped_steps"] == 0
    assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm"))
    assert all_finite(trainer)
    assert any(not torch.equal(before[n], p) for n, p in trainer.named_megatron_params())  # the rest trained


def test_left_out_sample_trains_nothing(model):
    """The same rollout with the bad sample's response replaced gives the same update: it contributes no token."""
    samples = rollout()
    samples[1].reward = float("nan")
    other = rollout()
    other[1].reward = float("nan")
    other[1].tokens = other[1].tokens[:5] + [7] * 6
    a, b = make_trainer(model), make_trainer(model)
    a.train_step(samples, rollout_id=0)
    b.train_step(other, rollout_id=0)
    for (n, pa), (_, pb) in zip(a.named_megatron_params(), b.named_megatron_params()):
        assert torch.allclose(pa, pb, atol=1e-6), n


def test_step_with_every_sample_left_out_is_skipped(model):
    trainer = make_trainer(model)
    samples = rollout()
    for s in samples:
        s.reward = float("nan")
    before = params(trainer)
    metrics = trainer.train_step(samples, rollout_id=0)
    assert metrics["skipped_steps"] == 1 and metrics["grad_norm"] is None
    assert all(torch.equal(before[n], p) for n, p in trainer.named_megatron_params())


@pytest.fixture
def nan_loss(monkeypatch):
    """A test double of the policy loss: the real terms, with sample 0 of each micro-batch's total made NaN."""
    real = losses.policy_loss_terms

    def poisoned(*args, **kwargs):
        terms = real(*args, **kwargs)
        terms.total = terms.total * torch.tensor([float("nan")] + [1.0] * (terms.total.shape[0] - 1),
                                                 device=terms.total.device)
        return terms

    monkeypatch.setattr(trainer_module.losses, "policy_loss_terms", poisoned)


def test_nonfinite_loss_skips_the_step_then_stops_the_run(model, nan_loss):
    trainer = make_trainer(model, max_consecutive_skipped_steps=2)
    before = params(trainer)
    metrics = trainer.train_step(rollout(), rollout_id=0)
    assert metrics["skipped_steps"] == 1 and metrics["skipped_steps_total"] == 1
    assert all(torch.equal(before[n], p) for n, p in trainer.named_megatron_params())
    stop = r"2 optimizer steps in a row.*loss not finite at rollout 1, optimizer step 0 \(this rank's samples " \
           r"with a non-finite loss: \[0, 2, 4\]"
    with pytest.raises(NonFiniteError, match=stop):
        trainer.train_step(rollout(), rollout_id=1)
    assert all(torch.equal(before[n], p) for n, p in trainer.named_megatron_params())


def test_infinite_gradient_norm_is_never_clipped_into_an_update(model):
    trainer = make_trainer(model, clip_grad=1.0)
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    handle = param.register_hook(lambda g: g * float("inf"))
    before = params(trainer)
    try:
        metrics = trainer.train_step(rollout(), rollout_id=0)
    finally:
        handle.remove()
    assert metrics["skipped_steps"] == 1
    assert all(torch.equal(before[n], p) for n, p in trainer.named_megatron_params())
    assert trainer.train_step(rollout(), rollout_id=1)["skipped_steps"] == 0  # a good step resets the count
    assert trainer.skips.consecutive == 0 and trainer.skips.total == 1


def test_skip_tracker_zero_never_stops():
    t = SkipTracker(0)
    for i in range(10):
        t.skipped(f"step {i}")
    assert t.total == 10


def test_nonfinite_weights_are_never_saved_or_synced(model, tmp_path):
    save = tmp_path / "ckpt"
    trainer = make_trainer(model, save=str(save))
    name, param = next(iter(trainer.model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteError, match=rf"not saved as iteration 0 .*\['{name}'\]"):
        trainer.save(0)
    assert not save.exists()
    actor = TrainActor(0, 1)
    actor.trainer = trainer  # the check runs before any engine is contacted
    with pytest.raises(NonFiniteError, match=rf"not synced into the engines as weight version '3'.*\['{name}'\]"):
        actor.sync_weights("3")


def test_a_colocated_trainer_checks_its_weights_once_as_it_leaves_the_gpu(model):
    trainer = make_trainer(model)
    actor = TrainActor(0, 1)
    actor.trainer = trainer
    checks = []
    real_check = trainer.check_weights_finite
    trainer.check_weights_finite = lambda purpose: checks.append(purpose) or real_check(purpose)
    actor.offload()
    assert len(checks) == 1 and "as the trainer leaves the GPU" in checks[0]
    with pytest.raises(RuntimeError, match="before connect_engines"):  # past the check, at the first engine call
        actor.sync_weights("1")
    assert len(checks) == 1  # an offloaded trainer's weights cannot have changed since
    actor.onload()
    with pytest.raises(RuntimeError, match="before connect_engines"):
        actor.sync_weights("2")
    assert len(checks) == 2 and "weight version '2'" in checks[1]


def test_nonfinite_weights_stop_the_offload_before_a_colocated_sync(model):
    trainer = make_trainer(model)
    name, param = next(iter(trainer.model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("inf")
    actor = TrainActor(0, 1)
    actor.trainer = trainer
    with pytest.raises(NonFiniteError, match=rf"not synced into the engines \(checked as the trainer leaves.*{name}"):
        actor.offload()
    assert actor.offload_state is None or not actor.offload_state.offloaded
