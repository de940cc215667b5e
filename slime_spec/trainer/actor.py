"""`TrainActor`: one train process as a Ray actor (the group that drives them is in group.py).

Besides training it holds, on global rank 0, the `WeightSyncer` that pushes the weights into the
engines; every rank takes part in a sync because gathering TP shards is collective. With --colocate and engines
spread over several trainer GPUs, every trainer rank on an engine's GPU hands that engine TP rank its own bucket
(weight_sync/transports/colocated.py): rank 0 leads the exchange, the others follow it.
"""

from __future__ import annotations

import itertools
from typing import Any

import ray

from slime_spec.common.net import listen_host, listen_socket
from slime_spec.config.run_config import TrainConfig, WeightSyncConfig
from slime_spec.rollout.sample import Sample


class TrainActor:
    """One train process; `run` lets other parts (the weight sync) execute code next to the model."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.trainer = None
        self.syncer = None  # rank 0 only, after connect_engines
        self.canary = None
        self.rank_buckets = None  # colocated.RankBuckets of this rank, when the colocated engines take per-rank buckets
        self.colocated_ranks = 0  # W: trainer ranks 0..W-1 hand their own buckets over (0: rank 0 sends alone)
        self.offload_state = None  # offload.TrainerOffload, made at the first offload (--colocate on GPUs)
        self.last_sync_metrics = None  # rank 0: the last sync's metrics, until canary_after reads them
        self.store_listener = None  # rank 0, between master_address and init: the store's listening socket

    def master_address(self) -> tuple[str, int]:
        """This node's address and a port already listening there, for rank 0 to host the process group's store
        (held until `init` hands it to the store)."""
        address = ray.util.get_node_ip_address()
        self.store_listener = listen_socket(listen_host(address))
        return address, self.store_listener.getsockname()[1]

    def init(self, train: TrainConfig, master_addr: str, master_port: int, draft_model_path: str | None = None) -> dict:
        from slime_spec.trainer.parallel import init_parallel
        from slime_spec.trainer.trainer import Trainer
        listener, self.store_listener = self.store_listener, None
        init_parallel(self.rank, self.world_size, master_addr, master_port, train.tensor_model_parallel_size,
                      train.seed, ep_size=train.expert_model_parallel_size,
                      etp_size=train.expert_tensor_parallel_size, store_listener=listener,
                      pp_size=train.pipeline_model_parallel_size, cp_size=train.context_parallel_size)
        self.trainer = Trainer(train, draft_model_path)
        return self.trainer.get_tp_info()

    def _ready(self):
        if self.trainer is None:
            raise RuntimeError("TrainActor.init() must run before any other call")
        return self.trainer

    def train_step(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        return self._ready().train_step(samples, rollout_id)

    def sft_step(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        return self._ready().sft_step(samples, rollout_id)

    def save(self, rollout_id: int, data_position: dict | None = None) -> str | None:
        path = self._ready().save(rollout_id, data_position)
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

    def offload(self) -> dict[str, float]:
        """This rank's GPU tensors to host memory (colocated engines generate meanwhile). The weights are checked
        for NaN and inf first, on the GPU: a colocated run syncs them after the offload, from host memory, and an
        offloaded trainer cannot change them (`sync_weights` does not check them again, which would copy each one
        to the GPU a second time)."""
        offloader = self._offloader()
        if not offloader.offloaded:
            self._ready().check_weights_finite("synced into the engines (checked as the trainer leaves the GPU; "
                                               "the engines keep serving the weights they have)")
        return offloader.offload()

    def onload(self) -> dict[str, float]:
        return self._offloader().onload()

    def _offloader(self):
        from slime_spec.trainer.offload import TrainerOffload
        if self.offload_state is None:
            self.offload_state = TrainerOffload(self._ready())
        return self.offload_state

    def forward_logits(self, input_ids: list[list[int]]) -> dict:
        return self._ready().forward_logits(input_ids)

    def connect_engines(self, urls: list[str], weight_sync: WeightSyncConfig, server_args: dict, model_path: str,
                        colocate: bool, engine_tp_size: int, disk_dir: str) -> None:
        """Rank 0: a WeightSyncer (and acceptance canary) for these engines. Colocated engines on the GPUs of
        several trainer ranks (tensor transport): every rank joins the per-rank bucket group (collective), so
        engine e's TP rank r gets the bucket of trainer rank e * engine_tp_size + r, the one on its GPU."""
        import torch

        from slime_spec.config.run_config import resolve_transport
        from slime_spec.weight_sync.transports.colocated import colocated_rank_buckets
        if colocate and resolve_transport(weight_sync.weight_sync_transport, colocate) == "tensor":
            self.rank_buckets, self.colocated_ranks = colocated_rank_buckets(
                self.rank, self.world_size, len(urls), engine_tp_size, cuda=torch.cuda.is_available())
        if self.rank != 0:
            return
        from slime_spec.fleet.client import EngineAuth, EngineClient
        from slime_spec.weight_sync.protocol import SpecSetup
        from slime_spec.weight_sync.sync import WeightSyncer
        from slime_spec.weight_sync.verify.canary import AcceptanceCanary
        trainer = self._ready()
        spec = SpecSetup.from_server_args(server_args, model_path)
        address = ray.util.get_node_ip_address()
        auth = EngineAuth.from_server_args(server_args)
        self.syncer = WeightSyncer(
            [EngineClient(u, auth) for u in urls], weight_sync, hf_config=trainer.hf_config,
            hf_checkpoint=trainer.train.hf_checkpoint, spec=spec, has_mtp_layers=bool(trainer.train.mtp_num_layers),
            transport=weight_sync.weight_sync_transport, colocate=colocate, master_address=address,
            backend="nccl" if torch.cuda.is_available() else "gloo", engine_tp_size=engine_tp_size,
            disk_dir=disk_dir, trains_draft=trainer.online_draft is not None, rank_buckets=self.rank_buckets)
        self.canary = AcceptanceCanary(spec, colocated=colocate) if spec.uses_draft else None
        self.syncer.prepare()  # the engines' protocol and the selector plan checked now, before the first rollout

    def canary_before(self, probe_tokens: list[list[int]]) -> None:
        """Rank 0: the acceptance canary's reading on the engines' current weights, taken now (the engines can
        generate) for a sync that runs later with `defer_canary` (colocated: the KV cache is then released)."""
        if self.rank == 0 and self.canary is not None:
            self.canary.set_probe_from_samples(probe_tokens)
            if self.canary.probe is not None:
                self.canary.read_before(self._syncer().clients)

    def canary_after(self) -> dict:
        """Rank 0: the canary's reading after the last sync (its metrics say what the sync sent), once the engines
        generate again; {} without a canary or a probe."""
        metrics, self.last_sync_metrics = self.last_sync_metrics, None
        if metrics is None or self.canary is None or self.canary.probe is None:
            return {}
        return self.canary.run(self._syncer().clients, "sync", sync_metrics=metrics)

    def _syncer(self):
        if self.syncer is None:
            raise RuntimeError("sync_weights before connect_engines")
        return self.syncer

    def sync_weights(self, weight_version: str, probe_tokens: list[list[int]] | None = None,
                     restarted_urls: list[str] | None = None, defer_canary: bool = False) -> dict:
        """Gather (every TP rank of the first replica, and of any replica on a colocated engine's GPU; every
        pipeline stage's to rank 0, or to every colocated rank), convert and send; returns rank 0's metrics. With
        per-rank buckets the ranks 1..W-1 hand theirs over through `follow_sync`; a failure on any of them fails the
        sync on every rank. With --enable-draft-training the online draft's own tensors follow the target's
        (selector `draft`).

        `restarted_urls`: engines restarted since the last sync; they rejoin the weight-update group first.
        `defer_canary`: the engines cannot generate now (their KV cache is released); the canary's reading before
        was taken by `canary_before`, and `canary_after` takes the one after.
        """
        from slime_spec.trainer.pipeline import weights_of_every_stage, weights_to_first_stage
        from slime_spec.weight_sync.gather import iter_draft_tensors, iter_hf_tensors, quantized
        from slime_spec.weight_sync.transports.colocated import follow_sync
        trainer = self._ready()
        if self.offload_state is None or not self.offload_state.offloaded:  # else checked by `offload`
            trainer.check_weights_finite(f"synced into the engines as weight version {weight_version!r} (the engines "
                                         "keep serving the weights they have)")
        first_of_tp_group = self.rank - trainer.tp.tp_rank  # Megatron's TP groups are consecutive ranks
        # Pipeline stages with per-rank buckets: every rank receives every stage's tensors (each feeds the engine on
        # its own GPU), so every rank takes part.
        every_stage_everywhere = trainer.tp.pp_size > 1 and self.colocated_ranks > 0
        # Every replica holds the same weights: only the first (all EP ranks of it: each holds other experts) gathers.
        if not every_stage_everywhere and trainer.tp.edp_rank != 0 and first_of_tp_group >= self.colocated_ranks:
            return {}
        stages = weights_of_every_stage if every_stage_everywhere else weights_to_first_stage
        tensors = stages(iter_hf_tensors(trainer.named_megatron_params(stage_copies=False), trainer.hf_config,
                                         **trainer.gather_groups()), trainer.device)
        stream = itertools.chain(tensors, iter_draft_tensors(trainer.named_draft_tensors()))
        if trainer.fp8 is not None:  # the engines serve the FP8 checkpoint: its weights quantized as it holds them
            stream = quantized(stream, trainer.fp8)
        if self.rank != 0:
            if self.rank_buckets is not None:
                follow_sync(self.rank_buckets, stream)
            else:
                for _ in tensors:  # take part in the collective gathers (and send a stage's to rank 0)
                    pass
            return {}
        syncer = self._syncer()
        if restarted_urls:
            syncer.rejoin(restarted_urls)
        if not defer_canary:
            self.canary_before(probe_tokens or [])  # acceptance on the weights this sync replaces
        metrics = syncer.sync(stream, weight_version=weight_version)
        self.last_sync_metrics = dict(metrics)
        if not defer_canary:
            metrics.update(self.canary_after())
        return metrics

    def shutdown(self) -> None:
        """Leave the weight-update group and the process groups; the latter even if the former fails."""
        from slime_spec.trainer.parallel import destroy_parallel
        try:
            if self.syncer is not None:
                self.syncer.close()
        finally:
            destroy_parallel()

