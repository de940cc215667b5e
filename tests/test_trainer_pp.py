"""Pipeline parallel size 2 on CPU (two Ray train actors, gloo, megatron-core's 1F1B schedule) computes what one rank
computes, MTP on the last stage included, gathers every stage's weights for the sync, and resumes per stage."""

from __future__ import annotations

import pytest

from slime_spec.trainer.pipeline import stage_layer_counts
from tests.helpers.tp_runs import local_ray_cluster, two_ranks_with_mtp_equal_one


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster(num_cpus=4):  # four train actors in the TP x PP test
        yield


@pytest.mark.nightly(
    covered_by="tests/test_trainer_pp.py::test_pp2_keeps_a_tied_embedding_and_its_last_stage_copy_equal_over_steps")
def test_four_ranks_in_two_stages_of_tp2_with_whole_experts_over_ep2_equal_one_rank_and_resume(ray_cluster, tmp_path):
    """GLM-4.5 on four ranks as slime's run-glm4.7-30B-A3B.sh lays out each stage (TP 2 with sequence parallelism,
    the routed experts whole, half on each TP rank as EP ranks: --expert-tensor-parallel-size 1), in two stages: the
    dense first layer on stage 0, the MoE layer, the output layer and the MTP layer (with its copy of the embedding)
    on stage 1; several packed micro-batches per step through megatron-core's schedule; each stage's tensors
    gathered (TP shards, EP ranks' experts), then sent to rank 0 for the sync. Each (TP rank, EP rank, stage)
    checkpoint shard resumes exactly. Two stages alone (two ranks) run through the whole loop in
    tests/e2e/test_mla_moe_pipeline_loop.py and tests/e2e/test_colocated_rank_buckets.py."""
    two_ranks_with_mtp_equal_one("glm4_moe", {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
                                              "expert_tensor_parallel_size": 1, "pipeline_model_parallel_size": 2},
                                 tmp_path, resume=True, ranks=4)


def test_stage_layer_counts_follow_megatron_and_name_the_flags():
    assert stage_layer_counts(4, 2) == [2, 2]
    assert stage_layer_counts(61, 4, last=13) == [16, 16, 16, 13]  # DeepSeek-R1's script
    assert stage_layer_counts(5, 3, first=1, last=2) == [1, 2, 2]
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 2"):
        stage_layer_counts(5, 2)
    with pytest.raises(ValueError, match="--decoder-last-pipeline-num-layers 4"):
        stage_layer_counts(4, 2, last=4)


def test_pp2_keeps_a_tied_embedding_and_its_last_stage_copy_equal_over_steps(ray_cluster, tmp_path):
    """Qwen3 ties its output layer to the embedding: the last stage computes logits with its own copy
    (megatron-core's `output_layer.weight` there), whose gradient is summed with the first stage's every step. Two
    GRPO steps with a KL reference match one rank's, and after them both copies are still the same tensor."""
    import ray
    import torch

    from slime_spec.config.run_config import EngineConfig
    from slime_spec.tools.tiny_model import make_tiny_model
    from slime_spec.trainer.group import TrainGroup
    from tests.helpers.tp_runs import assert_same_adam_step, grpo_steps_equal_one_rank, two_rank_config

    path = make_tiny_model(tmp_path / "ckpt", arch="qwen3", hidden_size=32, num_layers=4, seed=7)
    kw = dict(hf_checkpoint=str(path), lr=1e-3, global_batch_size=4, micro_batch_size=1, n_samples_per_prompt=2,
              use_kl_loss=True, kl_loss_coef=0.1)
    group = TrainGroup(two_rank_config(path, EngineConfig("embedded", str(path)),
                                       {**kw, "pipeline_model_parallel_size": 2}, tmp_path / "out"), use_gpu=False)
    try:
        before, after2, after1 = grpo_steps_equal_one_rank(group, kw)
        assert sorted(after2) == sorted(before) and "lm_head.weight" not in after2
        assert not torch.equal(after1["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
        assert_same_adam_step(after2, after1, [k for k in before if not k.endswith("k_proj.bias")], 2 * kw["lr"])
        first, last = (dict(ray.get(a.named_megatron_params.remote())) for a in group.actors)
        assert "decoder.layers.0.mlp.linear_fc1.weight" in first and "decoder.layers.2.mlp.linear_fc1.weight" in last
        assert "decoder.layers.2.mlp.linear_fc1.weight" not in first and "embedding.word_embeddings.weight" not in last
        assert torch.equal(first["embedding.word_embeddings.weight"], last["output_layer.weight"])  # the tied copy
    finally:
        group.shutdown()


def test_doctor_refuses_stages_that_do_not_split_the_layers_or_an_online_draft(tmp_path):
    from slime_spec.tools.tiny_model import make_tiny_model
    from tests.helpers.tp_runs import doctor_errors

    path = make_tiny_model(tmp_path, arch="qwen3", hidden_size=32, num_layers=3)

    def errors(*extra):
        return doctor_errors(path, "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2", *extra)

    assert any("3 decoder layers over --pipeline-model-parallel-size 2" in m for m in errors())
    assert errors("--decoder-last-pipeline-num-layers", "1") == []  # 2 + 1
    assert any("--enable-draft-training with --pipeline-model-parallel-size 2" in m
               for m in errors("--decoder-first-pipeline-num-layers", "1", "--enable-draft-training"))



@pytest.mark.parametrize("layout", [{"pipeline_model_parallel_size": 2}, {"context_parallel_size": 2}],
                         ids=["pp2", "cp2"])
def test_a_trainer_built_without_the_doctor_refuses_an_online_draft_in_its_words(layout):
    """Tests and benches build a Trainer directly: it refuses the layouts the doctor refuses, with the doctor's
    message, before it builds anything."""
    from slime_spec.config.run_config import TrainConfig
    from slime_spec.trainer.trainer import Trainer

    flag = next(iter(layout)).replace("_", "-")
    with pytest.raises(ValueError, match=f"--enable-draft-training with --{flag} 2: .*; fix: --{flag} 1"):
        Trainer(TrainConfig(hf_checkpoint="/nonexistent", enable_draft_training=True, **layout))


def _stage_streams(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks as two pipeline stages: each streams two tensors of its own to the sync's gathers, both
    ways (to rank 0, to every rank); then again with stage 1's stream failing after its first tensor."""
    import pickle

    import torch

    from slime_spec.trainer import parallel, pipeline
    from slime_spec.weight_sync.gather import NamedTensor

    parallel.init_parallel(rank, 2, "127.0.0.1", port, tp_size=1, seed=0, pp_size=2)

    def own(fail_at):
        for i in range(2):
            if rank == 1 and i == fail_at:
                raise RuntimeError("stage 1 lost a tensor (injected)")
            yield NamedTensor(f"model.layers.{2 * rank + i}.w", torch.full((2,), float(2 * rank + i)))

    result = {}
    for fail_at in (None, 1):
        for name, stages in (("first", pipeline.weights_to_first_stage), ("every", pipeline.weights_of_every_stage)):
            try:
                got = [(t.name, t.tensor.tolist()) for t in stages(own(fail_at), torch.device("cpu"))]
            except Exception as e:
                got = f"{type(e).__name__}: {e}"
            result[name, fail_at] = got
    with open(out, "wb") as f:
        pickle.dump(result, f)
    parallel.destroy_parallel()


def test_every_stages_weights_reach_rank_0_or_every_rank_and_a_failed_stage_is_named(tmp_path):
    import multiprocessing
    import pickle

    from slime_spec.common.net import free_port

    ctx, port = multiprocessing.get_context("spawn"), free_port()
    outs = [tmp_path / f"rank{r}.pkl" for r in range(2)]
    procs = [ctx.Process(target=_stage_streams, args=(r, port, str(outs[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert not [p for p in procs if p.is_alive()], "a stage hung"
    ranks = [pickle.loads(o.read_bytes()) for o in outs]
    whole = [(f"model.layers.{i}.w", [float(i)] * 2) for i in range(4)]
    assert ranks[0]["first", None] == whole and ranks[1]["first", None] == []  # stage 1 sent its own to rank 0
    assert ranks[0]["every", None] == whole and ranks[1]["every", None] == whole
    # stage 1 failed after sending one tensor: rank 0 fails naming it instead of waiting
    for r in ranks:
        assert "stage 1 lost a tensor" in r["first", 1] and "stage 1 lost a tensor" in r["every", 1], r
    assert "pipeline stage 1 (trainer rank 1) failed sending its weights" in ranks[0]["first", 1]
