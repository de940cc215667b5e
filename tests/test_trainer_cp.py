"""Context parallel size 2 on CPU (two Ray train actors, gloo): each rank runs two chunks of every row, attention
gathers the keys and values of both, and the ranks compute what one rank computes."""

from __future__ import annotations

import pytest
import torch

from slime_spec.trainer.context_parallel import gathered_order, row_positions
from tests.helpers.tp_runs import local_ray_cluster, two_ranks_with_mtp_equal_one


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster(num_cpus=4):  # four train actors at TP 2 x CP 2
        yield


def test_each_rank_holds_an_early_and_a_late_chunk_as_megatron_lays_them_out():
    """Megatron's load-balanced layout (get_batch_on_this_cp_rank, get_pos_emb_on_this_cp_rank): 2 x CP chunks,
    rank c holds chunks c and 2CP-1-c."""
    assert row_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert row_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert row_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    held = torch.cat([row_positions(12, 3, r) for r in range(3)])
    assert held[gathered_order(12, 3)].tolist() == list(range(12))
    with pytest.raises(ValueError, match="2 x --context-parallel-size 2"):
        row_positions(6, 2, 0)


@pytest.mark.nightly(
    covered_by="tests/test_trainer_cp.py::test_cp2_trains_padded_rows_of_a_dense_model_as_one_rank_over_steps")
def test_tp2_x_cp2_equals_one_rank_for_deepseek_v3_with_its_mtp_layer_trained_online(ray_cluster, tmp_path):
    """DeepSeek-V3 (multi-latent attention with YaRN RoPE picked per chunk by megatron-core, MoE, its MTP layer) at
    TP 2 x CP 2 on four ranks, its MoE layer sequence parallel, as slime's GLM-4.7, GLM4-9B and Qwen3-235B scripts
    lay theirs out. Packed rows of several samples split into 2 x CP chunks, attention across the ranks' chunks under
    the block-diagonal mask, the MTP layer's shifted inputs exchanged at the chunk boundaries (megatron-core's
    roll_tensor): logits, MTP logits, one step's metrics and the weights it moved equal one rank's; then target and
    MTP tensors reach a NEXTN engine, checked."""
    two_ranks_with_mtp_equal_one("deepseek_v3", {"tensor_model_parallel_size": 2, "context_parallel_size": 2},
                                 tmp_path, ranks=4)


def test_cp2_trains_padded_rows_of_a_dense_model_as_one_rank_over_steps(ray_cluster, tmp_path):
    """Qwen3 (grouped-query attention with q/k norms, tied embedding) in right-padded rows, one sample per micro-batch:
    two GRPO steps with a KL reference at CP 2 match one rank's."""
    from slime_spec.config.run_config import EngineConfig
    from slime_spec.tools.tiny_model import make_tiny_model
    from slime_spec.trainer.group import TrainGroup
    from tests.helpers.tp_runs import assert_same_adam_step, grpo_steps_equal_one_rank, two_rank_config

    path = make_tiny_model(tmp_path / "ckpt", arch="qwen3", hidden_size=32, num_layers=2, seed=7)
    kw = dict(hf_checkpoint=str(path), lr=1e-3, global_batch_size=4, micro_batch_size=1, n_samples_per_prompt=2,
              use_kl_loss=True, kl_loss_coef=0.1)
    group = TrainGroup(two_rank_config(path, EngineConfig("embedded", str(path)),
                                       {**kw, "context_parallel_size": 2}, tmp_path / "out"), use_gpu=False)
    try:
        assert [(i["cp_rank"], i["cp_size"], i["dp_size"]) for i in group.get_tp_info()] == [(0, 2, 1), (1, 2, 1)]
        before, after2, after1 = grpo_steps_equal_one_rank(group, kw)
        assert_same_adam_step(after2, after1, list(before), 2 * kw["lr"])
    finally:
        group.shutdown()


def test_doctor_refuses_cp_ranks_that_do_not_divide_the_gpus_an_online_draft_or_slimes_dsa_layout(tmp_path):
    from slime_spec.tools.tiny_model import make_tiny_model
    from tests.helpers.tp_runs import doctor_errors

    path = make_tiny_model(tmp_path, arch="qwen3", hidden_size=32, num_layers=2)

    def errors(*extra):
        return doctor_errors(path, "--actor-num-gpus-per-node", "4", "--context-parallel-size", "2", *extra)

    assert errors() == [] and errors("--tensor-model-parallel-size", "2") == []
    assert any("--tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1 x --context-parallel-size 2" in m
               for m in errors("--tensor-model-parallel-size", "3"))
    assert any("--enable-draft-training with --context-parallel-size 2" in m
               for m in errors("--enable-draft-training"))
    # slime's --allgather-cp is its contiguous layout for DSA attention models (DeepSeek-V3.2, GLM-5.1), refused for
    # others: the trainer keeps Megatron's load-balanced one
    assert any(m.startswith("--allgather-cp") for m in errors("--allgather-cp"))
