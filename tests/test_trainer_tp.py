"""Tensor parallel size 2 on CPU (two Ray train actors, gloo) computes what TP=1 computes, MTP included,
and the TrainGroup pushes its weights into a real embedded engine process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.config.run_config import EngineConfig, TrainConfig
from slime_spec.fleet.process import engine_server_process
from slime_spec.tools.tiny_model import make_tiny_eagle3_draft, make_tiny_model
from slime_spec.trainer import parallel
from slime_spec.trainer.group import TrainGroup
from slime_spec.trainer.trainer import EAGLE3_DRAFT_DIR, Trainer
from tests.helpers.tp_runs import (
    assert_same_adam_step,
    local_ray_cluster,
    tp2_config,
    varied_rollout,
)
from tests.helpers.tp_runs import tp_rollout as rollout

EAGLE = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 2, "speculative_eagle_topk": 1,
         "speculative_num_draft_tokens": 3}


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster():
        yield


def test_tp2_equals_tp1_forward_gather_and_train_step(ray_cluster, tmp_path):
    # vocab 101 is odd: TP=2 pads it to 102, and the padding must never show.
    path = make_tiny_model(tmp_path, arch="mimo", mtp_layers=1, seed=2)
    kw = dict(hf_checkpoint=str(path), mtp_num_layers=1, enable_mtp_training=True, lr=1e-3,
              global_batch_size=4, micro_batch_size=2, n_samples_per_prompt=2, use_kl_loss=True, kl_loss_coef=0.1)
    flags = tuple(x for k, v in EAGLE.items() for x in ("--" + k.replace("_", "-"), str(v)))
    engine = EngineConfig("embedded", str(path), forwarded_argv=flags, server_args=EAGLE)
    group = TrainGroup(tp2_config(path, engine, kw, tmp_path / "out"), use_gpu=False)
    server = engine_server_process(engine, log_path=tmp_path / "engine.log")
    try:
        assert [(i["tp_rank"], i["tp_size"], i["dp_size"]) for i in group.get_tp_info()] == [(0, 2, 1), (1, 2, 1)]
        parallel.init_single_process(seed=0)
        single = Trainer(TrainConfig(**kw))

        probe = [rollout()[0].tokens, rollout()[3].tokens]
        tp2, tp1 = group.forward_logits(probe), single.forward_logits(probe)
        assert tp2["logits"].shape == (2, 9, 101)
        torch.testing.assert_close(tp2["logits"], tp1["logits"], atol=1e-5, rtol=0)
        torch.testing.assert_close(tp2["mtp_logits"][0], tp1["mtp_logits"][0], atol=1e-5, rtol=0)

        # Shards gathered by tp_split_dim, then megatron_to_hf: exactly the checkpoint.
        hf = load_file(str(path / "model.safetensors"))
        gathered = group.hf_state_dict()
        assert sorted(gathered) == sorted(hf)
        assert all(torch.equal(gathered[k], hf[k]) for k in hf)

        m2, m1 = group.train_step(rollout(), 0), single.train_step(rollout(), 0)
        for key in ("loss", "pg_loss", "kl", "entropy", "mtp_loss", "grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
        after2, after1 = group.hf_state_dict(), single.hf_state_dict()
        moved = [k for k in hf if not torch.equal(after1[k], hf[k])]
        assert any(k.startswith("model.mtp_layers.") for k in moved) and "model.norm.weight" in moved
        assert_same_adam_step(after2, after1, hf, kw["lr"])

        # The trained TP=2 weights (MTP layers included) into an engine serving the original checkpoint;
        # check_weight_sync makes the syncer compare the engine's checksums with what was sent.
        server.start(timeout_s=120)
        group.connect_engines([server.url])
        metrics = group.sync_weights("0", probe_samples=rollout())
        # HF tensors: q/k/v, gate/up split
        assert metrics["weight_sync_params"] > 0 and metrics["weight_sync_mtp_params"] == 16
        assert metrics["spec_canary_accept_length"] >= 1.0
    finally:
        group.shutdown()
        server.stop()


def test_qwen3_moe_tp2_sequence_parallel_with_an_online_eagle3_draft_equals_tp1_and_syncs(ray_cluster, tmp_path):
    """megatron-core trains its MoE layer under TP only with sequence parallelism: two gloo ranks at TP 2 (the
    sequence split over them, experts split by expert-TP = TP) compute what one rank computes, packed rows of odd
    length included, and every expert's whole tensors reach an engine. With an EAGLE3 draft trained online (the
    Qwen3-235B-A22B seed's layout): each rank's draft reads the aux states of the whole sequence, so its loss, its
    step and the draft saved with the checkpoint equal one rank's, and the draft reaches the EAGLE3 engine too."""
    from tests.test_trainer_ep import expert_of

    path = make_tiny_model(tmp_path / "ckpt", arch="qwen3_moe", hidden_size=32, num_layers=4, num_experts=4,
                           num_experts_per_tok=2, seed=44)
    draft = make_tiny_eagle3_draft(tmp_path / "draft", path, draft_vocab_size=40)
    kw = dict(hf_checkpoint=str(path), lr=1e-3, global_batch_size=8, max_tokens_per_gpu=20, n_samples_per_prompt=2,
              enable_draft_training=True)
    eagle3 = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(draft),
              "speculative_num_steps": 2, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3}
    flags = tuple(x for k, v in eagle3.items() for x in ("--" + k.replace("_", "-"), str(v)))
    engine = EngineConfig("embedded", str(path), forwarded_argv=flags, server_args=eagle3)
    group = TrainGroup(tp2_config(path, engine, {**kw, "save": str(tmp_path / "two")}, tmp_path / "out"),
                       use_gpu=False)
    server = engine_server_process(engine, log_path=tmp_path / "engine.log")
    try:
        parallel.init_single_process(seed=0)
        single = Trainer(TrainConfig(**kw, save=str(tmp_path / "one")), str(draft))
        probe = [rollout()[0].tokens, rollout()[3].tokens]  # 9 tokens: padded to 10 for the two ranks
        torch.testing.assert_close(group.forward_logits(probe)["logits"], single.forward_logits(probe)["logits"],
                                   atol=1e-5, rtol=0)
        hf = load_file(str(path / "model.safetensors"))
        gathered = group.hf_state_dict()
        assert sorted(gathered) == sorted(hf) and all(torch.equal(gathered[k], hf[k]) for k in hf)

        m2, m1 = group.train_step(varied_rollout(), 0), single.train_step(varied_rollout(), 0)
        for key in ("loss", "pg_loss", "entropy", "grad_norm", "draft_loss", "draft_acc_step0", "draft_acc_last"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
        after2, after1 = group.hf_state_dict(), {k: v.clone() for k, v in single.hf_state_dict().items()}
        moved = {expert_of(k) for k in hf if not torch.equal(after1[k], hf[k])}
        assert {0, 1, 2, 3} <= moved and "model.layers.0.input_layernorm.weight" in \
            [k for k in hf if not torch.equal(after1[k], hf[k])]
        # the norms and the router see each rank's half of the sequence: their gradients summed over TP
        assert_same_adam_step(after2, after1, hf, kw["lr"])
        group.save(0)
        single.save(0)
        saved = [load_file(str(tmp_path / run / "iter_0000000" / EAGLE3_DRAFT_DIR / "model.safetensors"))
                 for run in ("two", "one")]
        initial = load_file(str(draft / "model.safetensors"))
        assert any(not torch.equal(saved[1][k], initial[k]) for k in initial)  # the draft trained
        assert_same_adam_step(saved[0], saved[1], [k for k in initial if k not in ("d2t", "t2d")], kw["lr"])

        server.start(timeout_s=120)
        group.connect_engines([server.url])
        metrics = group.sync_weights("0")
        assert metrics["weight_sync_params"] == len(hf) and metrics["weight_sync_draft_params"] > 0
    finally:
        group.shutdown()
        server.stop()
