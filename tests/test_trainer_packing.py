"""Packed micro-batches (--max-tokens-per-gpu): the plan, the row layout, attention that never crosses a
sample, and a packed step equal to the padded one (loss and gradients, MTP included)."""

from __future__ import annotations

import random

import pytest
import torch

from slime_spec.config.run_config import TrainConfig
from slime_spec.rollout.sample import Sample
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.trainer import batch as B
from slime_spec.trainer import model as M
from slime_spec.trainer import packing, parallel
from slime_spec.trainer.trainer import Trainer


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    parallel.init_single_process(seed=0)
    return make_tiny_model(tmp_path_factory.mktemp("mimo"), arch="mimo", mtp_layers=1, num_layers=2, seed=4)


def mixed_rollout(seed: int = 0, n_prompts: int = 2, n: int = 2) -> list[Sample]:
    """Mixed prompt and response lengths (1 to 12 response tokens), some with a loss mask and log-probs."""
    rng = random.Random(seed)
    out = []
    for g in range(n_prompts):
        prompt = [rng.randrange(5, 100) for _ in range(rng.randrange(1, 5))]
        for j in range(n):
            response = [rng.randrange(5, 100) for _ in range(rng.choice([1, 3, 12]))]
            out.append(Sample(index=len(out), group_index=g, prompt="p", tokens=prompt + response,
                              response_length=len(response), reward=float(j + g % 2),
                              loss_mask=[rng.randrange(2) for _ in response] if j else None,
                              rollout_log_probs=[-1.0] * len(response)))
    return out


def test_plan_balances_ranks_by_tokens_and_packs_under_the_budget():
    lengths = [10, 2, 9, 3, 8, 4, 1, 7]
    parts = B.balance_by_tokens(lengths, list(range(8)), 2)
    assert sorted(parts[0] + parts[1]) == list(range(8)) and len(parts[0]) == len(parts[1]) == 4
    assert abs(sum(lengths[i] for i in parts[0]) - sum(lengths[i] for i in parts[1])) <= 2
    bins = B.pack_by_tokens(lengths, list(range(8)), max_tokens=12)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins) and len(bins) == 4  # 44 tokens: 4 bins of 12
    steps = B.packed_step_slices(lengths, global_batch_size=4, max_tokens=12, dp_rank=1, dp_size=2)
    assert len(steps) == 2 and all(i < 4 for mb in steps[0] for i in mb) and all(i >= 4 for mb in steps[1] for i in mb)
    with pytest.raises(ValueError, match="sample 0 has 10 tokens, more than --max-tokens-per-gpu 9"):
        B.pack_by_tokens(lengths, [0, 1], max_tokens=9)
    with pytest.raises(ValueError, match="global-batch-size 3 must divide"):
        B.packed_step_slices(lengths, 3, 12, 0, 1)
    with pytest.raises(ValueError, match="multiple of the data-parallel size 3"):
        B.packed_step_slices(lengths[:4], 4, 12, 0, 3)


def test_packed_rows_layout():
    s0 = Sample(index=0, group_index=0, prompt="p", tokens=[5, 6, 7], response_length=1)
    s1 = Sample(index=1, group_index=0, prompt="p", tokens=[8, 9], response_length=1)
    tb = B.collate([s0, s1])
    rows = packing.packed_rows(tb)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9]] and rows.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    allowed = (~rows.attention_mask[0, 0]).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    per_token = torch.arange(1.0, 6.0)[None]  # value t+1 at row position t
    assert rows.to_samples(per_token).tolist() == [[0, 2, 3], [0, 5, 0]]  # column 0 and padding are 0
    padded = packing.padded_rows(tb)
    assert padded.to_samples(torch.tensor([[1.0, 2, 3], [4, 5, 6]])).tolist() == [[0, 2, 3], [0, 5, 0]]


def build(path):
    hf_config, hf_state = M.read_hf_config(path), M.read_hf_state(path)
    model = M.build_gpt_model(hf_config, TrainConfig(hf_checkpoint=str(path), mtp_num_layers=1))
    M.load_hf_weights(model, hf_state, hf_config, 0, 1)
    return model.eval(), hf_config["vocab_size"]


def packed_forward(model, vocab, samples):
    rows = packing.packed_rows(B.collate(samples))
    with torch.no_grad():
        out = M.forward(model, rows.input_ids, vocab, mtp_zero_first_token=True, position_ids=rows.position_ids,
                        attention_mask=rows.attention_mask)
    return out, rows


def test_a_packed_sample_never_attends_to_another_and_matches_its_own_forward(mimo):
    model, vocab = build(mimo)
    a = Sample(index=0, group_index=0, prompt="p", tokens=[11, 12, 13, 14, 15, 16], response_length=3)
    b = Sample(index=1, group_index=0, prompt="p", tokens=[21, 22, 23, 24], response_length=2)
    b2 = Sample(index=1, group_index=0, prompt="p", tokens=[31, 32, 33, 34], response_length=2)
    for first, second in ((a, b), (b, a)):
        out, _ = packed_forward(model, vocab, [first, second])
        with torch.no_grad():
            alone = M.forward(model, torch.tensor([second.tokens]), vocab, mtp_zero_first_token=True)
        n0, n1 = len(first.tokens), len(second.tokens)
        torch.testing.assert_close(out.logits[:, n0:], alone.logits, atol=1e-5, rtol=0)
        # MTP: the last position of a sample sees a rolled-in token from past its end (masked in the loss).
        torch.testing.assert_close(out.mtp_logits[0][:, n0:n0 + n1 - 1], alone.mtp_logits[0][:, :-1], atol=1e-5, rtol=0)
    out_b, _ = packed_forward(model, vocab, [a, b])
    out_b2, _ = packed_forward(model, vocab, [a, b2])
    n = len(a.tokens)
    assert torch.equal(out_b.logits[:, :n], out_b2.logits[:, :n])  # B's tokens changed, A's logits did not
    assert torch.equal(out_b.mtp_logits[0][:, :n - 1], out_b2.mtp_logits[0][:, :n - 1])
    assert not torch.allclose(out_b.logits[:, n:], out_b2.logits[:, n:])


def config(path, **kw) -> TrainConfig:
    base = dict(hf_checkpoint=str(path), mtp_num_layers=1, enable_mtp_training=True, lr=1e-3, global_batch_size=4,
                micro_batch_size=2, n_samples_per_prompt=2, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("loss_type", ["policy_loss", "sft"])
def test_packed_step_has_the_padded_steps_loss_and_gradients(mimo, loss_type):
    samples = mixed_rollout(seed=1)
    padded = Trainer(config(mimo, loss_type=loss_type))
    packed = Trainer(config(mimo, loss_type=loss_type, max_tokens_per_gpu=24, use_dynamic_batch_size=True))
    assert len([mb for step in packed.plan(samples) for mb in step]) >= 2  # really split into several rows
    g_pad, g_pack = padded.gradients(samples), packed.gradients(samples)
    assert set(g_pad) == set(g_pack) and any(n.startswith("mtp.") for n in g_pad)
    for name in g_pad:
        torch.testing.assert_close(g_pack[name], g_pad[name], atol=1e-5, rtol=1e-4, msg=name)
    m_pad, m_pack = padded.train_step(samples, 0), packed.train_step(samples, 0)
    for key in ("loss", "pg_loss", "kl", "entropy", "mtp_loss", "grad_norm"):
        assert m_pack[key] == pytest.approx(m_pad[key], rel=1e-4, abs=1e-6), key
    assert m_pack["mtp_loss"] > 0


def test_packing_flag_errors_name_the_flag(mimo):
    with pytest.raises(ValueError, match="--use-dynamic-batch-size needs --max-tokens-per-gpu"):
        Trainer(config(mimo, use_dynamic_batch_size=True))
    trainer = Trainer(config(mimo, max_tokens_per_gpu=8))
    with pytest.raises(ValueError, match="more than --max-tokens-per-gpu 8"):
        trainer.train_step(mixed_rollout(seed=1), 0)
