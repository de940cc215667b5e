"""Two train ranks on CPU in tests (TP 2, or EP 2): a private Ray cluster, a fixed rollout, the two-rank run's
Config, and the check that a two-rank train step moved the weights as one rank did."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import ray
import torch

from slime_spec.config.run_config import (
    ClusterConfig,
    Config,
    EngineConfig,
    RolloutConfig,
    TrainConfig,
    WandbConfig,
    WeightSyncConfig,
)
from slime_spec.rollout.sample import Sample


@contextmanager
def local_ray_cluster(num_cpus: int = 2):
    """A Ray cluster of this process's own (never a shared one), shut down on exit; `num_cpus`: the logical CPUs
    Ray schedules (one per train actor)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def tp_rollout() -> list[Sample]:
    """Two prompts of two samples each, the same every call; within a prompt, reward = sample number."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for g in range(2):
        prompt = torch.randint(5, 100, (4,), generator=gen).tolist()
        for j in range(2):
            response = torch.randint(5, 100, (5,), generator=gen).tolist()
            out.append(Sample(index=len(out), group_index=g, prompt="p", tokens=prompt + response,
                              response_length=5, reward=float(j)))
    return out


def varied_rollout() -> list[Sample]:
    """Four prompts of two samples, 5 to 14 tokens: packed micro-batches differ in number between two ranks."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for g in range(4):
        prompt = torch.randint(5, 100, (3 + g,), generator=gen).tolist()
        for j in range(2):
            response = torch.randint(5, 100, (2 + 3 * j + g,), generator=gen).tolist()
            out.append(Sample(index=len(out), group_index=g, prompt="p", tokens=prompt + response,
                              response_length=len(response), reward=float(j)))
    return out


def tp2_config(path, engine: EngineConfig, train_kw: dict, output_dir) -> Config:
    """Two gloo train ranks at TP 2, syncing into `engine` with the syncer's checksum check on."""
    return two_rank_config(path, engine, {**train_kw, "tensor_model_parallel_size": 2}, output_dir)


def two_rank_config(path, engine: EngineConfig, train_kw: dict, output_dir, ranks: int = 2) -> Config:
    """Two (or `ranks`) gloo train ranks laid out as `train_kw` says (TP, EP, PP sizes), syncing into `engine` with
    the syncer's checksum check on."""
    return Config(cluster=ClusterConfig(actor_num_nodes=1, actor_num_gpus_per_node=ranks), engine=engine,
                  rollout=RolloutConfig(hf_checkpoint=str(path)), train=TrainConfig(**train_kw),
                  weight_sync=WeightSyncConfig(weight_sync_transport="distributed", check_weight_sync=True),
                  wandb=WandbConfig(), output_dir=str(output_dir))


def assert_same_adam_step(after_tp2: dict, after_tp1: dict, keys, lr: float) -> None:
    """Adam's first step moves each weight by about lr * sign(grad): where a gradient is ~0, float noise between
    TP layouts can flip it, so compare against the step size, and require almost all weights to agree."""
    for k in keys:
        diff = (after_tp2[k] - after_tp1[k]).abs()
        assert float(diff.max()) < 0.2 * lr, k
        assert float((diff > 1e-5).float().mean()) < 0.01, k


def two_ranks_with_mtp_equal_one(arch: str, layout: dict, tmp_path, resume: bool = False, ranks: int = 2) -> None:
    """A tiny MoE model of `arch` with its MTP layer trained online, on two (or `ranks`) gloo train ranks laid out as
    `layout` says (TP, EP or PP sizes), computes what one rank computes: logits and MTP logits, the gathered weights,
    one packed step's metrics and the weights it moved (the MTP layer's among them); then target and MTP tensors
    reach a NEXTN engine, checked by its checksums. `resume`: the step is saved, and new ranks of the same layout
    resume it with exactly those weights."""
    from slime_spec.fleet.process import engine_server_process
    from slime_spec.tools.tiny_model import make_tiny_model
    from slime_spec.trainer import parallel
    from slime_spec.trainer.group import TrainGroup
    from slime_spec.trainer.trainer import Trainer
    path = make_tiny_model(tmp_path / "ckpt", arch=arch, hidden_size=32, num_layers=2, num_experts=4,
                           num_experts_per_tok=2, mtp_layers=1, first_k_dense_replace=1, seed=45)
    kw = dict(hf_checkpoint=str(path), lr=1e-3, global_batch_size=8, max_tokens_per_gpu=20, n_samples_per_prompt=2,
              mtp_num_layers=1, enable_mtp_training=True)
    nextn = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 2, "speculative_eagle_topk": 1,
             "speculative_num_draft_tokens": 3}
    flags = tuple(x for k, v in nextn.items() for x in ("--" + k.replace("_", "-"), str(v)))
    engine = EngineConfig("embedded", str(path), forwarded_argv=flags, server_args=nextn)
    save = {"save": str(tmp_path / "save")} if resume else {}
    group = TrainGroup(two_rank_config(path, engine, {**kw, **layout, **save}, tmp_path / "out", ranks), use_gpu=False)
    server = engine_server_process(engine, log_path=tmp_path / "engine.log")
    try:
        sizes = [(i["tp_size"], i["ep_size"], i["pp_size"]) for i in group.get_tp_info()]
        assert sizes == [(layout.get("tensor_model_parallel_size", 1), layout.get("expert_model_parallel_size", 1),
                          layout.get("pipeline_model_parallel_size", 1))] * ranks, sizes
        parallel.init_single_process(seed=0)
        single = Trainer(TrainConfig(**kw))
        probe = [tp_rollout()[0].tokens, tp_rollout()[3].tokens]  # 9 tokens: padded to 10 under sequence parallelism
        two, one = group.forward_logits(probe), single.forward_logits(probe)
        torch.testing.assert_close(two["logits"], one["logits"], atol=1e-5, rtol=0)
        torch.testing.assert_close(two["mtp_logits"][0], one["mtp_logits"][0], atol=1e-5, rtol=0)
        before = {k: v.clone() for k, v in single.hf_state_dict().items()}
        gathered = group.hf_state_dict()
        assert sorted(gathered) == sorted(before) and all(torch.equal(gathered[k], before[k]) for k in before)

        m2, m1 = group.train_step(varied_rollout(), 0), single.train_step(varied_rollout(), 0)
        for key in ("loss", "pg_loss", "entropy", "mtp_loss", "grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
        after2, after1 = group.hf_state_dict(), {k: v.clone() for k, v in single.hf_state_dict().items()}
        moved = [k for k in before if not torch.equal(after1[k], before[k])]
        assert "model.layers.2.eh_proj.weight" in moved and "model.layers.2.enorm.weight" in moved  # the MTP layer
        # a key bias shifts every score of a query alike, which softmax ignores: its exact gradient is 0, and Adam
        # turns float noise there into full steps of either sign
        assert_same_adam_step(after2, after1, [k for k in before if not k.endswith("k_proj.bias")], kw["lr"])

        if resume:
            group.save(0)

        server.start(timeout_s=120)
        group.connect_engines([server.url])
        metrics = group.sync_weights("0", probe_samples=tp_rollout())
        assert metrics["weight_sync_params"] > 0 and metrics["weight_sync_mtp_params"] > 0
    finally:
        group.shutdown()
        server.stop()
    if resume:  # each rank's shard (its TP slice, its EP rank's experts, its stage's layers) back where it was
        resumed = TrainGroup(two_rank_config(path, engine, {**kw, **layout, **save, "load": save["save"]},
                                             tmp_path / "out2", ranks), use_gpu=False)
        try:
            assert resumed.start_rollout_id() == 1
            again = resumed.hf_state_dict()
            assert sorted(again) == sorted(after2) and all(torch.equal(again[k], after2[k]) for k in after2)
        finally:
            resumed.shutdown()


def doctor_errors(checkpoint, *flags: str) -> list[str]:
    """The doctor's error messages for the embedded engine serving `checkpoint`, with `flags`."""
    from slime_spec.config.args import parse
    from slime_spec.doctor.diagnose import diagnose

    _, findings = diagnose(parse(["--hf-checkpoint", str(checkpoint), "--rollout-backend", "embedded", *flags]))
    return [f.message for f in findings if f.level == "error"]


def grpo_steps_equal_one_rank(group, kw: dict, steps: int = 2) -> tuple[dict, dict, dict]:
    """`steps` GRPO steps of `group` on `varied_rollout()` give one rank's (`TrainConfig(**kw)`) loss, KL, entropy and
    gradient norm; returns the HF weights before, after on the group and after on the one rank."""
    import pytest

    from slime_spec.config.run_config import TrainConfig
    from slime_spec.trainer import parallel
    from slime_spec.trainer.trainer import Trainer

    parallel.init_single_process(seed=0)
    single = Trainer(TrainConfig(**kw))
    before = {k: v.clone() for k, v in single.hf_state_dict().items()}
    for rollout_id in range(steps):
        m2, m1 = group.train_step(varied_rollout(), rollout_id), single.train_step(varied_rollout(), rollout_id)
        for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), (rollout_id, key)
    return before, group.hf_state_dict(), single.hf_state_dict()
