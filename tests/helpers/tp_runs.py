"""Two train ranks on CPU in tests (TP 2, or EP 2): a private Ray cluster, a fixed rollout, the two-rank run's
Config, and the check that a two-rank train step moved the weights as one rank did."""

from __future__ import annotations

from contextlib import contextmanager

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
def local_ray_cluster():
    """A Ray cluster of this process's own (never a shared one), shut down on exit."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
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


def tp2_config(path, engine: EngineConfig, train_kw: dict, output_dir) -> Config:
    """Two gloo train ranks at TP 2, syncing into `engine` with the syncer's checksum check on."""
    return two_rank_config(path, engine, {**train_kw, "tensor_model_parallel_size": 2}, output_dir)


def two_rank_config(path, engine: EngineConfig, train_kw: dict, output_dir) -> Config:
    """Two gloo train ranks laid out as `train_kw` says (TP, EP sizes), syncing into `engine` with the syncer's
    checksum check on."""
    return Config(cluster=ClusterConfig(actor_num_nodes=1, actor_num_gpus_per_node=2), engine=engine,
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
