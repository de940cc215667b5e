"""torch.distributed + megatron-core model-parallel state for one train process.

World = pipeline stages x data-parallel x context-parallel x tensor-parallel ranks (Megatron's order: TP ranks
consecutive, then CP, then DP, pipeline stages outermost); within a stage the MoE layers' experts are laid out on
Megatron's expert grid over the same ranks: expert TP (--expert-tensor-parallel-size, unset = TP), then
EP, then expert data parallel (the CP ranks among them). Data parallel size = world / (TP x PP x CP) as Megatron
computes it; the CP ranks of a data-parallel rank train the same samples, each on its part of every sequence
(trainer/context_parallel.py); each EP rank holds
num_experts / EP experts, each split over the expert-TP ranks. gloo on CPU, nccl on CUDA. Megatron's state is
process-global, so one process holds one model.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from slime_spec.common.net import listen_host, listen_on, listen_socket
from slime_spec.config.parallel_sizes import data_parallel_size
from slime_spec.config.run_config import expert_tensor_parallel_size
from slime_spec.trainer import cpu_compat


@dataclass(frozen=True)
class TPInfo:
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int = 0  # expert-parallel rank: holds experts ep_rank * E / ep_size .. (ep_rank + 1) * E / ep_size - 1
    ep_size: int = 1
    edp_rank: int = 0  # rank among the replicas of this rank's experts (expert data parallel)
    etp_rank: int = 0  # expert tensor parallel: each routed expert split over etp_size ranks
    etp_size: int = 1
    pp_rank: int = 0  # pipeline stage: holds its share of the decoder layers (pipeline.stage_layer_counts)
    pp_size: int = 1
    cp_rank: int = 0  # context parallel: holds two load-balanced chunks of every sequence (context_parallel.py)
    cp_size: int = 1


def init_parallel(rank: int, world_size: int, master_addr: str, master_port: int, tp_size: int,
                  seed: int, timeout_s: float = 600.0, ep_size: int = 1, etp_size: int | None = None,
                  store_listener: socket.socket | None = None, pp_size: int = 1, cp_size: int = 1) -> TPInfo:
    """Join the default process group and set Megatron's TP/DP/EP groups and RNG trackers. store_listener: rank 0's
    socket already listening at `master_port` (`net.listen_socket`), from before the other ranks were told the
    port; without one rank 0 binds the port now."""
    if pp_size < 1 or cp_size < 1 or not data_parallel_size(world_size, tp_size, pp_size, cp_size):
        raise ValueError(f"tensor_model_parallel_size={tp_size} x pipeline_model_parallel_size={pp_size} x "
                         f"context_parallel_size={cp_size} must divide the number of train processes ({world_size} = "
                         f"actor_num_nodes x actor_num_gpus_per_node)")
    etp_size = expert_tensor_parallel_size(tp_size, etp_size)
    if ep_size < 1 or etp_size < 1 or (world_size // pp_size) % (etp_size * ep_size):
        raise ValueError(f"expert_model_parallel_size={ep_size} x expert_tensor_parallel_size={etp_size} must divide "
                         f"the train processes of a pipeline stage ({world_size // pp_size} = actor_num_nodes x "
                         f"actor_num_gpus_per_node / pipeline_model_parallel_size); choose "
                         f"--expert-model-parallel-size accordingly")
    cpu_compat.apply()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        backend, timeout = "nccl" if use_cuda else "gloo", timedelta(seconds=timeout_s)
        store = rendezvous_store(rank, world_size, master_addr, master_port, timeout, store_listener)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                                 pipeline_model_parallel_size=pp_size,
                                                 context_parallel_size=cp_size,
                                                 expert_model_parallel_size=ep_size,
                                                 expert_tensor_parallel_size=etp_size)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return current_tp_info()




def rendezvous_store(rank: int, world_size: int, host: str, port: int, timeout: timedelta,
                     listener: socket.socket | None = None) -> dist.TCPStore:
    """The process group's store: rank 0 serves it on `listener` (or a socket it binds now), on `host` itself when
    that is a loopback address (torch's own TCPStore server would listen on every interface whatever host it is
    given); the other ranks connect to host:port."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    if listener is None:
        listener = listen_on(listen_host(host), port)
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.detach())


def init_single_process(seed: int = 1234) -> TPInfo:
    """One process, TP=1: tests, the debug trainer, scripts."""
    listener = listen_socket("127.0.0.1")
    return init_parallel(0, 1, "127.0.0.1", listener.getsockname()[1], tp_size=1, seed=seed, store_listener=listener)


def current_tp_info() -> TPInfo:
    from megatron.core import parallel_state as ps

    return TPInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                  tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                  dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                  ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
                  edp_rank=ps.get_expert_data_parallel_rank(), etp_rank=ps.get_expert_tensor_parallel_rank(),
                  etp_size=ps.get_expert_tensor_parallel_world_size(),
                  pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
                  cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size())


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
