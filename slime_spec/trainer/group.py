"""`TrainGroup`: every train actor of a run, driven as one.

actor_num_nodes x actor_num_gpus_per_node actors form one torch.distributed world (nccl with GPUs,
gloo without), split into tensor-parallel groups of --tensor-model-parallel-size and data-parallel
replicas. Every call goes to every actor (Megatron's collectives need them all); results are
identical across ranks, so the group returns rank 0's.
"""

from __future__ import annotations

import os
from pathlib import Path

import ray

from slime_spec.cluster.placement import TRAIN_GPU_FRACTION, Placement, in_bundle
from slime_spec.config.parallel_sizes import data_parallel_size
from slime_spec.config.run_config import Config
from slime_spec.rollout.sample import Sample
from slime_spec.trainer.actor import TrainActor


def train_actor_env(use_gpu: bool, num_ranks: int, environ=os.environ) -> dict[str, str]:
    """Environment variables of every train actor (Ray merges them with the job's).

    NCCL_CUMEM_ENABLE=0 (unless the job sets it): the weight-update group's NCCL communicator then tears down
    without waiting for its peers, as SGLang's own processes and slime's trainer run it; it must be set before
    the actor's first NCCL communicator. On CPU (gloo) each process keeps to its share of the cores and sees no GPU:
    Ray leaves CUDA_VISIBLE_DEVICES alone for an actor that asks for none, and a rank that saw one would train on it,
    every rank on the same device (NCCL refuses that)."""
    env = {"NCCL_CUMEM_ENABLE": environ.get("NCCL_CUMEM_ENABLE", "0")}
    if not use_gpu:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_ranks))
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class TrainGroup:
    def __init__(self, config: Config, use_gpu: bool | None = None, placement: Placement | None = None):
        """`placement`: rank r runs in the run's r-th sorted bundle with `TRAIN_GPU_FRACTION` of its GPU (the
        rest of that GPU is a colocated engine's); without one, a whole GPU each when the cluster has them."""
        self.config = config
        cluster, train = config.cluster, config.train
        n = cluster.actor_num_nodes * cluster.actor_num_gpus_per_node
        if not data_parallel_size(n, train.tensor_model_parallel_size, train.pipeline_model_parallel_size,
                                  train.context_parallel_size):
            raise ValueError(f"--tensor-model-parallel-size {train.tensor_model_parallel_size} x "
                             f"--pipeline-model-parallel-size {train.pipeline_model_parallel_size} x "
                             f"--context-parallel-size {train.context_parallel_size} must divide "
                             f"--actor-num-nodes x --actor-num-gpus-per-node = {n}")
        if placement is not None and len(placement.assignment.actor_bundles) != n:
            raise ValueError(f"the placement holds {len(placement.assignment.actor_bundles)} train bundle(s) for "
                             f"--actor-num-nodes x --actor-num-gpus-per-node = {n} ranks")
        if placement is not None:
            use_gpu, num_gpus = True, TRAIN_GPU_FRACTION
        else:
            if use_gpu is None:
                use_gpu = ray.cluster_resources().get("GPU", 0) >= n
            num_gpus = 1 if use_gpu else 0
        self.uses_gpu = use_gpu  # the ranks train on GPUs (with --colocate their memory is offloaded meanwhile)
        actor_cls = ray.remote(num_gpus=num_gpus, num_cpus=1)(TrainActor)
        self.actors = []
        for rank in range(n):
            options: dict = {}
            if placement is not None:
                options["scheduling_strategy"] = in_bundle(placement, placement.assignment.actor_bundles[rank])
            options["runtime_env"] = {"env_vars": train_actor_env(use_gpu, n)}
            self.actors.append(actor_cls.options(**options).remote(rank, n))
        master_addr, master_port = ray.get(self.actors[0].master_address.remote())
        draft_path = config.engine.server_args.get("speculative_draft_model_path")  # EAGLE3 online training
        self.tp_infos = ray.get([a.init.remote(train, master_addr, master_port, draft_path) for a in self.actors])

    def _all(self, method: str, *args, **kwargs) -> list:
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def train_step(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        return self._all("train_step", samples, rollout_id)[0]

    def sft_step(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Supervised warm-up step (e.g. to fit fresh MTP layers before RL), whatever --loss-type is."""
        return self._all("sft_step", samples, rollout_id)[0]

    def save(self, rollout_id: int, data_position: dict | None = None) -> None:
        self._all("save", rollout_id, data_position)

    def start_rollout_id(self) -> int:
        """The first rollout to run: 0, or the one after the checkpoint --load resumed from."""
        return self._all("start_rollout_id")[0]

    def get_tp_info(self) -> list[dict]:
        return self._all("get_tp_info")

    def hf_state_dict(self) -> dict:
        return self._all("hf_state_dict")[0]

    def offload(self) -> dict[str, float]:
        """Every rank's GPU tensors to host memory (colocated engines generate meanwhile); the slowest rank's
        seconds (trainer/offload.py)."""
        return _slowest(self._all("offload"))

    def onload(self) -> dict[str, float]:
        return _slowest(self._all("onload"))

    def forward_logits(self, input_ids: list[list[int]]) -> dict:
        return self._all("forward_logits", input_ids)[0]

    def connect_engines(self, urls: list[str]) -> None:
        c = self.config
        disk_dir = str(Path(c.output_dir) / "weight_sync_disk")
        self._all("connect_engines", list(urls), c.weight_sync, dict(c.engine.server_args), c.engine.model_path,
                  c.cluster.colocate, c.engine.num_gpus_per_engine, disk_dir)

    def sync_weights(self, weight_version: str, probe_samples: list[Sample] | None = None,
                     restarted_urls: list[str] | None = None, defer_canary: bool = False) -> dict:
        """The current weights into every engine as `weight_version`; engines at `restarted_urls` (restarted
        since the last sync) rejoin the weight-update group first. Returns the sync (and canary) metrics; with
        `defer_canary` the canary is `canary_before` and `canary_after`'s (the engines cannot generate)."""
        return self._all("sync_weights", weight_version, _probe_tokens(probe_samples), list(restarted_urls or []),
                         defer_canary)[0]

    def canary_before(self, probe_samples: list[Sample]) -> None:
        """The acceptance canary's reading on the engines' current weights (rank 0 holds the canary)."""
        ray.get(self.actors[0].canary_before.remote(_probe_tokens(probe_samples)))

    def canary_after(self) -> dict:
        return ray.get(self.actors[0].canary_after.remote())

    def shutdown(self) -> None:
        if not self.actors:
            return
        try:
            self._all("shutdown")
        finally:
            for a in self.actors:
                ray.kill(a)
            self.actors = []


def _probe_tokens(samples: list[Sample] | None) -> list[list[int]]:
    return [list(s.tokens) for s in samples or [] if s.tokens]


def _slowest(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the largest value over the ranks (a collective move ends when its slowest rank does)."""
    return {k: max(m[k] for m in per_rank if k in m) for k in {k for m in per_rank for k in m}}
