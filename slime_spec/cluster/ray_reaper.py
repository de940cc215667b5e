"""A watchdog that stops a private local Ray when its driver dies without shutting it down (SIGKILL, a crash).

`ray.init()` without an address starts gcs_server, raylet, the dashboard and runtime-env agents, workers and,
through them, the engine servers, all as descendants of the driver. A driver that exits normally (or on
Ctrl-C / SIGTERM) stops them through `ray.shutdown`; a SIGKILLed driver cannot, and Ray 2.60 leaves its agents
running for minutes. The reaper is a small process of its own session (a terminal's Ctrl-C does not reach it)
that keeps a fresh list of the driver's descendants and, once the driver is gone, stops every one of them
still alive after `SETTLE_S` (a clean `ray.shutdown` needs that long to finish; the reaper then signals
nothing and says nothing): SIGTERM, then SIGKILL after `GRACE_S`. It knows processes by (pid, start time), so a
reused pid is never touched, and it touches nothing that was not the driver's descendant.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

import psutil

REFRESH_S = 0.5
SETTLE_S = 2.0
GRACE_S = 3.0
READY = "watching"  # the reaper's one line on stdout: it holds the driver and has listed its descendants once
READY_TIMEOUT_S = 60.0


def descendants(pid: int) -> dict[int, float]:
    """{pid: start time} of every live descendant of `pid` (empty once `pid` is gone)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for c in children:
        try:
            out[c.pid] = c.create_time()
        except psutil.NoSuchProcess:
            continue
    return out


def live_processes(known: dict[int, float]) -> list[psutil.Process]:
    """The processes of `known` ({pid: start time}) still running: same pid and start time, not a zombie."""
    procs = []
    for pid, started in known.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                procs.append(p)
        except psutil.NoSuchProcess:
            continue
    return procs


def stop_all(known: dict[int, float], settle_s: float = SETTLE_S, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every process of `known` (same pid and start time) still alive after `settle_s`, SIGKILL
    those left after `grace_s` more; returns the pids signalled."""
    _, procs = psutil.wait_procs(live_processes(known), timeout=settle_s)
    _signal_each(procs, psutil.Process.terminate)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    _signal_each(alive, psutil.Process.kill)
    return [p.pid for p in procs]


def _signal_each(procs: list[psutil.Process], send) -> None:
    for p in procs:
        try:
            send(p)
        except psutil.NoSuchProcess:
            pass


def watch(driver_pid: int, refresh_s: float = REFRESH_S, on_ready=None) -> list[int]:
    """Track the driver's descendants until it exits, then stop those left; returns the pids stopped.
    `on_ready()` runs once the driver is held and its descendants listed. ProcessLookupError if the driver is
    gone already (its descendants can no longer be told from anyone's)."""
    me = os.getpid()
    fd = os.pidfd_open(driver_pid)
    known = descendants(driver_pid)
    known.pop(me, None)
    if on_ready is not None:
        on_ready()
    try:
        while not select.select([fd], [], [], refresh_s)[0]:
            seen = descendants(driver_pid)
            seen.pop(me, None)
            known.update(seen)
    finally:
        os.close(fd)
    return stop_all(known)


def start_reaper(driver_pid: int | None = None, ready_timeout_s: float = READY_TIMEOUT_S) -> subprocess.Popen:
    """Spawn the reaper for `driver_pid` (this process by default), in a session of its own, and return once it
    watches: a driver killed before then would leave its processes unknown to it."""
    pid = os.getpid() if driver_pid is None else driver_pid
    command = [sys.executable, "-m", "slime_spec.cluster.ray_reaper", str(pid)]
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    line = proc.stdout.readline().strip() if select.select([proc.stdout], [], [], ready_timeout_s)[0] else ""
    proc.stdout.close()
    if line != READY:
        proc.kill()
        raise RuntimeError(f"the Ray reaper ({' '.join(command)}) did not start watching within "
                           f"{ready_timeout_s:.0f} s (exit code {proc.wait()}; its error, if any, is above)")
    return proc


def main(argv: list[str]) -> int:
    try:
        stopped = watch(int(argv[0]), on_ready=lambda: print(READY, flush=True))
    except ProcessLookupError:
        print(f"[ray_reaper] driver {argv[0]} had exited before the reaper could watch it: the processes it left are "
              "not known, none was stopped", file=sys.stderr, flush=True)
        return 1
    if stopped:
        print(f"[ray_reaper] driver {argv[0]} exited; stopped {len(stopped)} process(es) it left: {stopped}",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
