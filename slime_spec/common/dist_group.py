"""A torch.distributed group outside the default one, for pushing weights into engines.

The trainer's rank 0 and every engine join one group (trainer = rank 0, engine i =
rank_offset + i), the way SGLang's `/init_weights_update_group` does. It must not touch
the default process group: the trainer already has Megatron's, the engine has none.
gloo on CPU, nccl on CUDA.

SGLang's receiver joins through torch's own group machinery: a `tcp://` rendezvous, a
`PrefixStore(group_name, ...)` over it, then `_new_process_group_helper`, which adds its own
key prefixes for the backend. A sender must go through the same steps, or both sides wait for
keys the other never writes. We do exactly that here, without initializing the default group.

Closing is collective too. With NCCL's cuMem buffers (its default; SGLang and slime turn them off with
NCCL_CUMEM_ENABLE=0) a rank's communicator teardown waits until every other rank tears down (seen on two H200s,
NCCL 2.28: a destroy returned only when the peer destroyed, 15 s later), so the ranks must destroy together, as
they joined. `WeightUpdateGroup.destroy` is bounded: past its timeout the communicator is aborted, which never
waits for peers, and `GroupCloseTimeout` says which group and why.

The members of one NCCL group must agree on NCCL_CUMEM_ENABLE: a trainer with cuMem buffers off and an engine with
them on hung in their first sync (same machine). A process whose first NCCL communicator is this group (the
embedded engine, the benches) takes SGLang's default, 0, where its environment says nothing; the trainer actors get
0 in their environment (trainer/group.py). Rank 0 writes its value to the group's store and every other rank that
runs this code checks it against its own, so a mismatch fails the join with an error instead of hanging.
"""

from __future__ import annotations

import os
import socket
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
               backend: str, timeout: timedelta, listener: socket.socket | None = None) -> dist.ProcessGroup:
    """Join a named group through torch's rendezvous, as any rank (0 hosts the store). listener: rank 0's socket
    already listening at `master_port` (`net.listen_socket`), which its store serves on."""
    if listener is not None:
        if rank != 0:
            raise ValueError(f"only rank 0 hosts the group's store; rank {rank} was given a listening socket")
        store = dist.TCPStore(master_address, master_port, world_size, True, timeout,
                              master_listen_fd=listener.detach())
    else:
        store, rank, world_size = next(c10d.rendezvous(tcp_url(master_address, master_port), rank, world_size,
                                                       timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    if backend == "nccl":
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # read by NCCL at the process's first communicator
        check_same_cumem(store, rank)
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


CUMEM_KEY = "slime_spec/nccl_cumem_enable"  # in the group's store, beside torch's own keys


def check_same_cumem(store, rank: int) -> None:
    """Rank 0 publishes its NCCL_CUMEM_ENABLE; any other rank raises if its own differs (waits for rank 0's value
    as long as the store's timeout). An SGLang engine never reads the key: SGLang sets 0 in its processes."""
    mine = os.environ.get("NCCL_CUMEM_ENABLE", "")
    if rank == 0:
        store.set(CUMEM_KEY, mine)
        return
    theirs = store.get(CUMEM_KEY).decode()
    if theirs != mine:
        raise ValueError(f"NCCL_CUMEM_ENABLE is {mine or 'unset'} here (rank {rank}) but {theirs or 'unset'} on "
                         f"rank 0 (the trainer): NCCL hangs when the members of a group disagree on it. Set the same "
                         f"value for the trainer and every engine (0, as SGLang and slime-spec's trainer actors use)")


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
    if tensor.is_floating_point() and tensor.element_size() == 1:  # float8: gloo has no such type, so its bytes
        tensor = tensor.view(torch.uint8)  # travel as uint8 (into the same memory), as NCCL's own mapping does
    pg.broadcast([tensor], opts).wait()


DESTROY_TIMEOUT_S = 60.0  # a destroy takes well under a second when every rank destroys together
ABORT_GRACE_S = 10.0  # for the blocked teardown to return once its communicator is aborted


class GroupCloseTimeout(TimeoutError):
    """A group's teardown did not finish in time: some rank never destroyed it."""


class GroupBroken(RuntimeError):
    """A collective of the group failed (a member died or left): the group cannot be used again; destroy it."""


def destroy_bounded(pg, timeout_s: float, what: str) -> None:
    """`destroy_process_group(pg)`, given up after `timeout_s`: then the communicator is aborted (local, it waits
    for no peer) and GroupCloseTimeout names `what` and the likely cause."""
    outcome: dict = {}

    def run() -> None:
        try:
            dist.destroy_process_group(pg)
        except BaseException as e:  # re-raised on the caller's thread
            outcome["error"] = e

    worker = threading.Thread(target=run, name="destroy-process-group", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not worker.is_alive():
        if "error" in outcome:
            raise outcome["error"]
        return
    try:
        pg.abort()
        aborted = "its communicator was aborted"
    except Exception as e:
        aborted = f"aborting its communicator failed too ({e!r})"
    worker.join(ABORT_GRACE_S)
    raise GroupCloseTimeout(
        f"destroying {what} did not finish in {timeout_s:g} s; {aborted}"
        + ("" if not worker.is_alive() else "; the teardown thread is still blocked") +
        ". Every rank must destroy the group at the same time (NCCL's teardown waits for its peers): the trainer "
        "destroys it while every engine serves /destroy_weights_update_group. A rank that never does (an engine "
        "that missed the request, a process stuck elsewhere) holds the others here; NCCL_CUMEM_ENABLE=0 in every "
        "member makes the teardown local.")



class WeightUpdateGroup:
    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo",
                 timeout_s: float = 300.0, listener: socket.socket | None = None):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not group_name:
            raise ValueError("group_name must not be empty (SGLang refuses an empty weight-update group name)")
        self.rank, self.world_size, self.backend, self.group_name = rank, world_size, backend, group_name
        self._pg = join_group(master_address, master_port, rank, world_size, group_name, backend,
                              timedelta(seconds=timeout_s), listener)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Raises GroupBroken when a member is gone. The error holds no reference to the group, so `destroy` then
        frees it, which closes its connections: the other members' pending receives fail at once instead of
        waiting for the group's timeout (a gloo group lives, connections open, while anything references it, and
        a caught error's traceback references the frames that hold it)."""
        try:
            broadcast(self._pg, tensor, src)
            return
        except RuntimeError as e:
            failure = str(e)
        raise GroupBroken(f"broadcast in weight-update group {self.group_name!r} (rank {self.rank} of "
                          f"{self.world_size}, {self.backend}) failed: {failure}")

    def barrier(self) -> None:
        t = torch.zeros(1, device="cuda" if self.backend == "nccl" else "cpu")
        self._pg.allreduce([t]).wait()

    def destroy(self, timeout_s: float = DESTROY_TIMEOUT_S) -> None:
        """Leave the group and free it. Every other rank must destroy it at the same time (NCCL's teardown waits
        for them): past `timeout_s` the communicator is aborted and GroupCloseTimeout is raised. Idempotent."""
        pg, self._pg = self._pg, None
        if pg is None or pg not in c10d._world.pg_names:  # an in-process member registers nothing
            return
        try:
            destroy_bounded(pg, timeout_s, f"weight-update group {self.group_name!r} (rank {self.rank} of "
                                           f"{self.world_size}, {self.backend})")
        finally:
            release_name(self.group_name)

