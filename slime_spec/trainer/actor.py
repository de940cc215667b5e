"""Ray side of the trainer: `TrainActor` (one train process) and `TrainGroup` (all of them).

actor_num_nodes x actor_num_gpus_per_node actors form one torch.distributed world (nccl with GPUs,
gloo without), split into tensor-parallel groups of --tensor-model-parallel-size and data-parallel
replicas. Every call goes to every actor (Megatron's collectives need them all); results are
identical across ranks, so the group returns rank 0's.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import ray

from slime_spec.config import ClusterConfig, TrainConfig
from slime_spec.rollout.sample import Sample


class TrainActor:
    """One train process; `run` lets other parts (the weight sync) execute code next to the model."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.trainer = None

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process group's store."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init(self, train: TrainConfig, master_addr: str, master_port: int) -> dict:
        from slime_spec.trainer.parallel import init_parallel
        from slime_spec.trainer.trainer import Trainer

        init_parallel(self.rank, self.world_size, master_addr, master_port, train.tensor_model_parallel_size,
                      train.seed)
        self.trainer = Trainer(train)
        return self.trainer.get_tp_info()

    def _ready(self):
        if self.trainer is None:
            raise RuntimeError("TrainActor.init() must run before any other call")
        return self.trainer

    def train_step(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        return self._ready().train_step(samples, rollout_id)

    def save(self, rollout_id: int) -> str | None:
        path = self._ready().save(rollout_id)
        return str(path) if path else None

    def start_rollout_id(self) -> int:
        return self._ready().start_rollout_id

    def get_tp_info(self) -> dict:
        return self._ready().get_tp_info()

    def named_megatron_params(self) -> list[tuple[str, Any]]:
        """This rank's (name, shard) pairs, copied out of the actor (in-process code uses the trainer's iterator)."""
        return list(self._ready().named_megatron_params())

    def hf_state_dict(self) -> dict:
        return self._ready().hf_state_dict()

    def forward_logits(self, input_ids: list[list[int]]) -> dict:
        return self._ready().forward_logits(input_ids)

    def run(self, fn: Callable, *args, **kwargs) -> Any:
        """fn(trainer, *args, **kwargs) inside this process (e.g. the weight sync's gather-and-send)."""
        return fn(self._ready(), *args, **kwargs)

    def shutdown(self) -> None:
        from slime_spec.trainer.parallel import destroy_parallel

        destroy_parallel()


class TrainGroup:
    """All train actors; each method calls every actor and returns rank 0's result (`*_all`: every rank's)."""

    def __init__(self, cluster: ClusterConfig, train: TrainConfig, use_gpu: bool | None = None,
                 placement_group=None, bundle_indices: list[int] | None = None):
        n = cluster.actor_num_nodes * cluster.actor_num_gpus_per_node
        if n % train.tensor_model_parallel_size:
            raise ValueError(f"--tensor-model-parallel-size {train.tensor_model_parallel_size} must divide "
                             f"--actor-num-nodes x --actor-num-gpus-per-node = {n}")
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) >= n
        actor_cls = ray.remote(num_gpus=1 if use_gpu else 0, num_cpus=1)(TrainActor)
        self.actors = []
        for rank in range(n):
            options: dict = {}
            if placement_group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                index = bundle_indices[rank] if bundle_indices else rank
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=index)
            if not use_gpu:  # gloo on CPU: keep each process to its share of the cores
                threads = str(max(1, (os.cpu_count() or 1) // n))
                options["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": threads}}
            self.actors.append(actor_cls.options(**options).remote(rank, n))
        master_addr, master_port = ray.get(self.actors[0].master_address.remote())
        self.tp_infos = ray.get([a.init.remote(train, master_addr, master_port) for a in self.actors])

    def _all(self, method: str, *args, **kwargs) -> list:
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def train_step(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        return self._all("train_step", samples, rollout_id)[0]

    def save(self, rollout_id: int) -> None:
        self._all("save", rollout_id)

    def start_rollout_id(self) -> int:
        return self._all("start_rollout_id")[0]

    def get_tp_info(self) -> list[dict]:
        return self._all("get_tp_info")

    def hf_state_dict(self) -> dict:
        return self._all("hf_state_dict")[0]

    def forward_logits(self, input_ids: list[list[int]]) -> dict:
        return self._all("forward_logits", input_ids)[0]

    def run_all(self, fn: Callable, *args, **kwargs) -> list:
        return self._all("run", fn, *args, **kwargs)

    def shutdown(self) -> None:
        self._all("shutdown")
        for a in self.actors:
            ray.kill(a)
        self.actors = []
