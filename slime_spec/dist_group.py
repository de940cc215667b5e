"""A torch.distributed group outside the default one, for pushing weights into engines.

The trainer's rank 0 and every engine join one group (trainer = rank 0, engine i =
rank_offset + i), the way SGLang's `/init_weights_update_group` does. It must not touch
the default process group: the trainer already has Megatron's, the engine has none.
gloo on CPU, nccl on CUDA.

SGLang's receiver joins through torch's own group machinery: a `tcp://` rendezvous, a
`PrefixStore(group_name, ...)` over it, then `_new_process_group_helper`, which adds its own
key prefixes for the backend. A sender must go through the same steps, or both sides wait for
keys the other never writes. We do exactly that here, without initializing the default group.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def tcp_url(host: str, port: int) -> str:
    """`tcp://host:port`, with an IPv6 host in brackets (what SGLang's NetworkAddress.to_tcp writes)."""
    return f"tcp://[{host}]:{int(port)}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{int(port)}"


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout: timedelta) -> dist.ProcessGroup:
    """Join a named group through torch's rendezvous, as any rank (0 hosts the store)."""
    store, rank, world_size = next(c10d.rendezvous(tcp_url(master_address, master_port), rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                           c10d.PrefixStore(group_name, store), group_name=group_name,
                                           timeout=timeout)
    # the group's ranks are its own global ranks: lets torch.distributed collectives take src=0
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class WeightUpdateGroup:
    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo",
                 timeout_s: float = 300.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not group_name:
            raise ValueError("group_name must not be empty (SGLang refuses an empty weight-update group name)")
        self.rank, self.world_size, self.backend, self.group_name = rank, world_size, backend, group_name
        self._pg = join_group(master_address, master_port, rank, world_size, group_name, backend,
                              timedelta(seconds=timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        dist.broadcast(tensor, src=src, group=self._pg)

    def barrier(self) -> None:
        t = torch.zeros(1, device="cuda" if self.backend == "nccl" else "cpu")
        dist.all_reduce(t, group=self._pg)

    def destroy(self) -> None:
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
        self._pg = None
