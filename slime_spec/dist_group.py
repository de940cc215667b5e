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

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def tcp_url(host: str, port: int) -> str:
    """`tcp://host:port`, with an IPv6 host in brackets (what SGLang's NetworkAddress.to_tcp writes)."""
    return f"tcp://[{host}]:{int(port)}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{int(port)}"


# Group names this process has handed to torch's registry (torch registers a name once per process).
_REGISTERED: set[str] = set()
_REGISTERED_LOCK = threading.Lock()


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout: timedelta) -> dist.ProcessGroup:
    """Join a named group through torch's rendezvous, as any rank (0 hosts the store)."""
    store, rank, world_size = next(c10d.rendezvous(tcp_url(master_address, master_port), rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    with _REGISTERED_LOCK:
        first_in_process = group_name not in _REGISTERED
        _REGISTERED.add(group_name)
    if not first_in_process:
        return same_process_member(store, rank, world_size, group_name, backend, timeout)
    try:
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                               group_name=group_name, timeout=timeout)
    except BaseException:
        release_name(group_name)
        raise
    # the group's ranks are its own global ranks: lets torch.distributed collectives take src=0
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def release_name(group_name: str) -> None:
    with _REGISTERED_LOCK:
        _REGISTERED.discard(group_name)


def same_process_member(store, rank: int, world_size: int, group_name: str, backend: str, timeout: timedelta):
    """Another rank of a group whose name this process already registered (in-process engine doubles in
    tests): it builds the same backends as `_new_process_group_helper`, on the same keys
    (`<group_name>/<device>/`; one backend when torch maps every device to the same one), outside the registry."""
    prefix = c10d.PrefixStore(f"{group_name}/", store)
    device_map = c10d.BackendConfig(c10d.Backend(backend)).get_device_backend_map()
    devices = list(device_map)[:1] if len(set(device_map.values())) == 1 else list(device_map)  # as torch does
    members = []
    for device in devices:
        device_store = c10d.PrefixStore(f"{device}/", prefix)
        if backend == "gloo":
            member = dist.ProcessGroupGloo(device_store, rank, world_size, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            member = dist.ProcessGroupNCCL(device_store, rank, world_size, opts)
        member._set_sequence_number_for_group()
        members.append(member)
    return members[0]


def broadcast(pg, tensor: torch.Tensor, src: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    pg.broadcast([tensor], opts).wait()


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
        broadcast(self._pg, tensor, src)

    def barrier(self) -> None:
        t = torch.zeros(1, device="cuda" if self.backend == "nccl" else "cpu")
        self._pg.allreduce([t]).wait()

    def destroy(self) -> None:
        if self._pg is not None and self._pg in c10d._world.pg_names:
            dist.destroy_process_group(self._pg)
            release_name(self.group_name)
        self._pg = None
