"""Expert parallel size 2 on CPU (two Ray train actors, gloo, megatron-core's all-gather token dispatcher): each rank
loads and trains only its half of the experts and computes what one rank holding every expert computes; the weight
sync gathers every expert into a real embedded engine process; a checkpoint saved under EP 2 resumes exactly. EP over
the TP ranks, in pipeline stages, with packed micro-batches: tests/test_trainer_pp.py."""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file

from slime_spec.config.run_config import EngineConfig, TrainConfig
from slime_spec.fleet.process import engine_server_process
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.trainer import parallel
from slime_spec.trainer.batch import collate, packed_step_slices, split_into
from slime_spec.trainer.group import TrainGroup
from slime_spec.trainer.packing import packed_rows
from slime_spec.trainer.trainer import Trainer
from tests.helpers.tp_runs import (
    assert_same_adam_step,
    local_ray_cluster,
    two_rank_config,
    varied_rollout,
)
from tests.helpers.tp_runs import tp_rollout as rollout


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster():
        yield


def expert_of(hf_name: str) -> int | None:
    parts = hf_name.split(".")
    return int(parts[5]) if parts[3:5] == ["mlp", "experts"] else None


def test_ep2_equals_ep1_forward_gather_train_step_sync_and_resume(ray_cluster, tmp_path):
    path = make_tiny_model(tmp_path / "ckpt", arch="qwen3_moe", hidden_size=32, num_layers=2, num_experts=4,
                           num_experts_per_tok=2, seed=41)
    kw = dict(hf_checkpoint=str(path), lr=1e-3, global_batch_size=4, micro_batch_size=1, n_samples_per_prompt=2,
              use_kl_loss=True, kl_loss_coef=0.1)
    save_dir = tmp_path / "save"
    engine = EngineConfig("embedded", str(path))
    ep_kw = dict(kw, expert_model_parallel_size=2, save=str(save_dir))
    group = TrainGroup(two_rank_config(path, engine, ep_kw, tmp_path / "out"), use_gpu=False)
    server = engine_server_process(engine, log_path=tmp_path / "engine.log")
    resumed = None
    try:
        # Megatron's layout: data parallel = world / TP = 2, and EP rank r holds experts 2r, 2r + 1 as local 0, 1.
        assert [(i["ep_rank"], i["ep_size"], i["dp_size"], i["edp_rank"]) for i in group.get_tp_info()] == \
            [(0, 2, 2, 0), (1, 2, 2, 0)]
        hf = load_file(str(path / "model.safetensors"))
        for rank, params in enumerate(ray.get([a.named_megatron_params.remote() for a in group.actors])):
            experts = dict(p for p in params if ".local_experts." in p[0])
            assert sorted({n.split(".local_experts.")[1].split(".")[0] for n in experts}) == ["0", "1"]
            fc2 = experts["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"]
            assert torch.equal(fc2, hf[f"model.layers.1.mlp.experts.{2 * rank + 1}.down_proj.weight"])

        parallel.init_single_process(seed=0)
        single = Trainer(TrainConfig(**kw))
        assert single.tp.ep_size == 1
        probe = [rollout()[0].tokens, rollout()[3].tokens]
        ep2, ep1 = group.forward_logits(probe), single.forward_logits(probe)
        torch.testing.assert_close(ep2["logits"], ep1["logits"], atol=1e-5, rtol=0)

        # Every EP rank's experts gathered and renamed to their global numbers: exactly the checkpoint.
        gathered = group.hf_state_dict()
        assert sorted(gathered) == sorted(hf)
        assert all(torch.equal(gathered[k], hf[k]) for k in hf)

        m2, m1 = group.train_step(rollout(), 0), single.train_step(rollout(), 0)
        for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
        after2, after1 = group.hf_state_dict(), {k: v.clone() for k, v in single.hf_state_dict().items()}
        moved = {expert_of(k) for k in hf if not torch.equal(after1[k], hf[k])}
        assert {0, 1, 2, 3} <= moved and None in moved  # experts of both EP ranks trained, and the rest
        assert_same_adam_step(after2, after1, hf, kw["lr"])

        group.save(0)
        assert sorted(p.name for p in (save_dir / "iter_0000000").glob("*.pt")) == \
            ["tp_rank_00_ep_rank_00.pt", "tp_rank_00_ep_rank_01.pt"]

        # Every expert from both EP ranks into an engine serving the original checkpoint; check_weight_sync makes
        # the syncer compare the engine's checksums with what was sent.
        server.start(timeout_s=120)
        group.connect_engines([server.url])
        metrics = group.sync_weights("0")
        assert metrics["weight_sync_params"] == len(hf)
    finally:
        group.shutdown()
        server.stop()
    try:  # the EP 2 checkpoint, resumed by two new ranks: the same weights, and the next rollout
        resumed = TrainGroup(two_rank_config(path, engine, dict(ep_kw, load=str(save_dir)), tmp_path / "out2"),
                             use_gpu=False)
        assert resumed.start_rollout_id() == 1
        again = resumed.hf_state_dict()
        assert all(torch.equal(again[k], after2[k]) for k in hf)
    finally:
        if resumed is not None:
            resumed.shutdown()


def test_equal_counts_split_the_fewer_packs_and_padding_is_a_segment_of_its_own():
    lengths = [len(s.tokens) for s in varied_rollout()]
    alone = [packed_step_slices(lengths, 8, 20, r, 2) for r in range(2)]
    equal = [packed_step_slices(lengths, 8, 20, r, 2, equal_counts=True) for r in range(2)]
    assert sorted(len(p[0]) for p in alone) == [2, 3]  # first-fit alone: the ranks would disagree
    assert [len(p[0]) for p in equal] == [3, 3]
    for a, e in zip(alone, equal):  # the same samples, no bin over the budget
        assert sorted(i for mb in a[0] for i in mb) == sorted(i for mb in e[0] for i in mb)
        assert all(sum(lengths[i] for i in mb) <= 20 for mb in e[0])
    assert split_into([[0, 1, 2]], 3, [4, 5, 6]) == [[2], [0], [1]]  # halved (6 + 4 | 5), then 6 | 4

    batch = collate(varied_rollout()[:2])
    plain, padded = packed_rows(batch), packed_rows(batch, min_len=30)
    assert plain.input_ids.shape == (1, 13) and padded.input_ids.shape == (1, 30)  # samples of 5 and 8 tokens
    assert torch.equal(padded.attention_mask[..., :13, :13], plain.attention_mask)
    assert bool(padded.attention_mask[0, 0, 13:, :13].all()) and bool(padded.attention_mask[0, 0, :13, 13:].all())
    assert torch.equal(padded.index, plain.index) and torch.equal(padded.valid, plain.valid)
