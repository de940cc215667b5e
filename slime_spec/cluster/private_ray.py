"""A driver's private local Ray: started on loopback with a reaper beside it, and stopped so that the driver
exits only once every process of that Ray is gone.

`ray.shutdown()` waits for the processes Ray's node started (gcs_server, raylet, agents), not for the workers
(actors, idle workers) and what they started: those are the raylet's, and one it did not stop exits on its own once
its raylet is gone. `stop()` waits for them (bounded), so a finished or signalled run leaves nothing for the reaper
(ray_reaper.py), whose part is a driver that could not stop Ray itself (SIGKILL, a crash).
"""

from __future__ import annotations

import os
import subprocess
import time

import psutil

from slime_spec.cluster.ray_env import pin_private_ray_to_loopback, ray_init_kwargs
from slime_spec.cluster.ray_reaper import descendants, live_processes, start_reaper

STOP_WAIT_S = 20.0  # workers notice their raylet is gone within ~1 s on an idle machine

_reaper: subprocess.Popen | None = None  # set while this process has a private Ray running
_node: dict[int, float] = {}  # {pid: start time} of what ray.init started here: Ray's node (gcs_server, raylet, ...)


def start() -> None:
    """Start a private Ray on 127.0.0.1, watched by a reaper of this process."""
    import ray

    global _reaper, _node
    pin_private_ray_to_loopback(os.environ)
    _reaper = start_reaper()
    before = descendants(os.getpid())
    ray.init(**ray_init_kwargs(os.environ, os.cpu_count()))
    # Ray's node runs as this process's children; told apart from what was here before by pid and start time
    _node = {pid: t for pid, t in descendants(os.getpid()).items() if before.get(pid) != t and pid != _reaper.pid}


def running() -> bool:
    """Whether this process started the private Ray it is connected to (and has not stopped it)."""
    return _reaper is not None


def stop(wait_s: float = STOP_WAIT_S) -> list[str]:
    """`ray.shutdown()`, then wait until every process of the private Ray (its servers, workers and their
    descendants) has exited; returns those still alive after `wait_s`, described (the reaper stops them once
    this driver exits). A no-op returning [] where this process started no private Ray."""
    import ray

    global _reaper, _node
    if _reaper is None:
        return []
    known = _processes_of_ray(_reaper.pid)
    ray.shutdown()
    _reaper, _node = None, {}
    return [_describe(p) for p in _wait_gone(known, wait_s)]


def _wait_gone(known: dict[int, float], wait_s: float, poll_s: float = 0.1) -> list[psutil.Process]:
    """Poll until none of `known` ({pid: start time}) is alive; those still alive after `wait_s`. A zombie counts as
    gone (ray_reaper.live_processes; not `psutil.wait_procs`: it waits on one whose parent has not reaped it, as in a
    container whose init does not)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = live_processes(known)
        if not alive or time.monotonic() > deadline:
            return alive
        known = {p.pid: known[p.pid] for p in alive}
        time.sleep(poll_s)


def _processes_of_ray(reaper_pid: int) -> dict[int, float]:
    """The processes Ray's node started in this driver (at `start`) still running, and every descendant of theirs
    now (workers, engine servers): {pid: start time}."""
    known: dict[int, float] = {}
    for p in live_processes(_node):
        known[p.pid] = _node[p.pid]
        known.update(descendants(p.pid))
    known.pop(reaper_pid, None)
    return known


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.name()}"
    except psutil.Error:
        return f"{p.pid} (gone)"
