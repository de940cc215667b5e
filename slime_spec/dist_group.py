"""A torch.distributed group outside the default one, for pushing weights into engines.

The trainer's rank 0 and every engine join one group (trainer = rank 0, engine i =
rank_offset + i), the way SGLang's `/init_weights_update_group` does. It must not touch
the default process group: the trainer already has Megatron's, the engine has none.
gloo on CPU, nccl on CUDA.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class WeightUpdateGroup:
    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo",
                 timeout_s: float = 300.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.rank, self.world_size, self.backend, self.group_name = rank, world_size, backend, group_name
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, int(master_port), world_size,
                              is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
        self._store = dist.PrefixStore(group_name, store)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(self._store, rank, world_size, opts)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        t = torch.zeros(1, device="cuda" if self.backend == "nccl" else "cpu")
        self._pg.allreduce([t]).wait()

    def destroy(self) -> None:
        self._pg = None
        self._store = None
