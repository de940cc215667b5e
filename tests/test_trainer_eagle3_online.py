"""Online EAGLE3 draft training next to the policy: TTT loss, detachment, sync names, checkpoints."""

from __future__ import annotations

import random

import pytest
import torch

from slime_spec.common import eagle3_draft as E
from slime_spec.config.run_config import TrainConfig
from slime_spec.rollout.sample import Sample
from slime_spec.tools.tiny_model import LLAMA31_ROPE_SCALING, make_tiny_eagle3_draft, make_tiny_model
from slime_spec.trainer import model as M
from slime_spec.trainer import parallel
from slime_spec.trainer.eagle3_ttt import ttt_loss
from slime_spec.trainer.trainer import Trainer


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    parallel.init_single_process(seed=0)
    root = tmp_path_factory.mktemp("eagle3_online")
    target = make_tiny_model(root / "target", arch="llama", num_layers=4, seed=3, rope_scaling=LLAMA31_ROPE_SCALING,
                             rope_theta=500000.0)
    return target, make_tiny_eagle3_draft(root / "draft", target, draft_vocab_size=40)


def rollout(seed: int = 0, n_prompts: int = 2, n: int = 2) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(n_prompts):
        prompt = [rng.randrange(5, 45) for _ in range(5)]
        for j in range(n):
            response = [rng.randrange(5, 45) for _ in range(10 + 3 * j)]
            out.append(Sample(index=len(out), group_index=g, prompt="p", tokens=prompt + response,
                              response_length=len(response), reward=float(j)))
    return out


def config(llama, **kw) -> TrainConfig:
    target, draft = llama
    base = dict(hf_checkpoint=str(target), enable_draft_training=True, lr=1e-3,
                draft_lr=3e-3, draft_ttt_steps=3, global_batch_size=4, micro_batch_size=2, n_samples_per_prompt=2)
    return TrainConfig(**{**base, **kw})


def make_trainer(llama, draft_path: str | None = "default", **kw) -> Trainer:
    return Trainer(config(llama, **kw), str(llama[1]) if draft_path == "default" else draft_path)


def policy_features(trainer: Trainer, ids: torch.Tensor):
    return M.forward(trainer.model, ids, trainer.vocab_size, aux_layer_ids=trainer.online_draft.aux_layer_ids)


def test_ttt_step0_is_the_reference_forward(llama):
    trainer = make_trainer(llama)
    ids = torch.randint(5, 45, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = policy_features(trainer, ids)
        draft = trainer.online_draft.draft
        positions = torch.arange(17)[None].expand(2, -1)
        shifted = torch.cat([out.embeds[:, 1:], torch.zeros_like(out.embeds[:, :1])], 1)
        ref_logits, _ = draft(shifted, out.aux_hidden, positions)
        one = ttt_loss(draft, out.embeds, out.aux_hidden, out.logits, positions, torch.ones(2, 17), steps=1)
    assert out.aux_hidden.shape == (2, 17, 3 * 64) and out.embeds.shape == (2, 17, 64)
    ce = -(torch.softmax(out.logits[:, 1:-1][..., draft.t2d], -1) * torch.log_softmax(ref_logits[:, :-2], -1)).sum(-1)
    counted = draft.t2d[out.logits[:, 1:-1].argmax(-1)]
    torch.testing.assert_close(one.loss, (ce * counted).sum() / counted.sum(), atol=1e-5, rtol=1e-5)


def test_draft_loss_never_reaches_the_target(llama):
    trainer = make_trainer(llama)
    trainer.model.train()
    ids = torch.randint(5, 45, (2, 15), generator=torch.Generator().manual_seed(1))
    out = policy_features(trainer, ids)
    trainer.online_draft.accumulate(out, torch.arange(15)[None].expand(2, -1), torch.ones(2, 15), None, 1.0)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.online_draft.draft.parameters())


def test_train_steps_lower_draft_loss_and_leave_the_target_to_its_own_loss(llama):
    trainer = make_trainer(llama, lr=0.0)  # a frozen policy: only the draft loss could move anything
    before = {n: p.clone() for n, p in trainer.named_megatron_params()}
    draft_before = {n: t.clone() for n, t in trainer.named_draft_tensors()}
    samples = rollout()
    losses = [trainer.train_step(samples, rollout_id=i)["draft_loss"] for i in range(6)]
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(torch.equal(before[n], p) for n, p in trainer.named_megatron_params())
    assert all(not torch.equal(draft_before[n], t) for n, t in trainer.named_draft_tensors())


def test_packed_rows_train_the_draft(llama):
    trainer = make_trainer(llama, max_tokens_per_gpu=64)
    metrics = trainer.train_step(rollout(seed=2), rollout_id=0)
    assert metrics["draft_loss"] > 0 and 0 <= metrics["draft_acc_step0"] <= 1


def test_synced_names_are_exactly_the_drafts_own(llama):
    trainer = make_trainer(llama)
    names = [n for n, _ in trainer.named_draft_tensors()]
    checkpoint_names = set(E.trainable_state(trainer.online_draft.draft)) - {"d2t", "t2d"}
    assert set(names) == checkpoint_names and len(names) == len(set(names))
    assert not any("embed" in n for n in names)
    from slime_spec.weight_sync.gather import iter_draft_tensors
    assert {(t.name, t.kind) for t in iter_draft_tensors(trainer.named_draft_tensors())} == \
        {(n, "draft") for n in names}


def test_flag_off_keeps_the_draft_frozen(llama):
    trainer = make_trainer(llama, enable_draft_training=False)
    assert trainer.online_draft is None and list(trainer.named_draft_tensors()) == []
    assert "draft_loss" not in trainer.train_step(rollout(), rollout_id=0)


def test_draft_is_checkpointed_with_the_policy(llama, tmp_path):
    trainer = make_trainer(llama, save=str(tmp_path))
    trainer.train_step(rollout(), rollout_id=0)
    trainer.save(0)
    resumed = make_trainer(llama, load=str(tmp_path))
    for (n, a), (m, b) in zip(trainer.named_draft_tensors(), resumed.named_draft_tensors()):
        assert n == m and torch.equal(a, b)
    assert resumed.online_draft.optimizer.state_dict()["state"]
    exported = E.load_draft(tmp_path / "iter_0000000" / "eagle3_draft", num_target_layers=4)
    for n, t in trainer.named_draft_tensors():
        assert torch.equal(E.trainable_state(exported)[n], t), n
    with pytest.raises(ValueError, match="--sglang-speculative-draft-model-path"):
        make_trainer(llama, draft_path=None)


def test_bf16_policy_trains_a_float32_draft(llama):
    trainer = make_trainer(llama, bf16=True)
    metrics = trainer.train_step(rollout(seed=3), rollout_id=0)
    assert trainer.online_draft.draft.fc.weight.dtype == torch.float32
    assert metrics["draft_loss"] == metrics["draft_loss"] and metrics["draft_loss"] > 0


def test_ttt_attention_sees_the_context_then_its_own_later_steps():
    """Step k at position i attends to step-0 keys 0..i and to its own keys of steps 1..k (brute force)."""
    from slime_spec.trainer.eagle3_ttt import _attend
    gen = torch.Generator().manual_seed(0)
    b, heads, kv, s, d, steps = 2, 4, 2, 6, 8, 3
    q = torch.randn(b, heads, s, d, generator=gen)
    keys = [torch.randn(b, kv, s, d, generator=gen) for _ in range(steps)]
    values = [torch.randn(b, kv, s, d, generator=gen) for _ in range(steps)]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    out = _attend(q, keys, values, causal)
    for i in range(s):
        k_i = torch.cat([keys[0][:, :, :i + 1]] + [k[:, :, i:i + 1] for k in keys[1:]], dim=2)
        v_i = torch.cat([values[0][:, :, :i + 1]] + [v[:, :, i:i + 1] for v in values[1:]], dim=2)
        k_i, v_i = k_i.repeat_interleave(heads // kv, 1), v_i.repeat_interleave(heads // kv, 1)
        w = torch.softmax(q[:, :, i:i + 1] @ k_i.transpose(-1, -2) / d ** 0.5, dim=-1)
        torch.testing.assert_close(out[:, :, i:i + 1], w @ v_i, atol=1e-5, rtol=1e-5)
