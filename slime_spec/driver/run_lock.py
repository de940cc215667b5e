"""One run per output directory: a lock file in --output-dir (and in --save) for as long as the run lives.

The lock is created atomically (O_EXCL) and holds the owner's pid, host, start time and command line. A second
run into the same directory is refused with the owner's identity. A lock whose owner is gone (same host, pid
not running, or a pid since reused by another process) is stale: it is taken over, and the console says so.
A lock from another host cannot be checked from here: it is refused with the path to delete if that run is gone.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = ".slime_spec_run.lock"


class RunLocked(RuntimeError):
    """Another run uses the directory; the message names it."""


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), to tell a reused pid apart; None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def owner_gone(owner: dict) -> bool:
    """Whether the run that wrote `owner` has ended (checkable only on its own host)."""
    if owner.get("host") != socket.gethostname():
        return False
    pid = int(owner["pid"])
    if not _alive(pid):
        return True
    started = owner.get("process_start")
    return started is not None and _process_start(pid) not in (None, started)


def describe(owner: dict) -> str:
    return (f"pid {owner.get('pid')} on host {owner.get('host')}, started {owner.get('started')} "
            f"({owner.get('command', '?')})")


class RunLock:
    """`with RunLock([dirs], argv):` holds a lock in each directory for the body's duration."""

    def __init__(self, directories: list[str | Path], argv: list[str] | None = None):
        seen, self.paths = set(), []
        for d in directories:
            path = Path(d).resolve() / LOCK_NAME
            if path not in seen:
                seen.add(path)
                self.paths.append(path)
        pid = os.getpid()
        self.identity = {"pid": pid, "host": socket.gethostname(), "process_start": _process_start(pid),
                         "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                         "command": " ".join(["python -m slime_spec.train", *(argv or [])])[:300]}
        self.held: list[Path] = []

    def acquire(self) -> None:
        try:
            for path in self.paths:
                self._take(path)
                self.held.append(path)
        except BaseException:
            self.release()
            raise

    def _take(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):  # a second try after removing a stale lock
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    owner = json.loads(path.read_text())
                except (OSError, ValueError) as e:
                    raise RunLocked(f"{path.parent} is locked by {path}, which cannot be read ({e}); if no run uses "
                                    f"this directory, delete {path}") from e
                if not owner_gone(owner):
                    raise RunLocked(f"{path.parent} is in use by another run: {describe(owner)}. Wait for it to end "
                                    f"or choose another --output-dir / --save; if that run is gone, delete {path}")
                print(f"[train] {path.parent}: the run that locked it ({describe(owner)}) is gone; taking the lock "
                      "over", file=sys.stderr, flush=True)
                path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.identity, f)
            return
        raise RunLocked(f"{path.parent}: another run took the lock {path} while a stale one was being replaced")

    def release(self) -> None:
        """Remove the locks this run holds (only while they are still its own)."""
        for path in self.held:
            try:
                if json.loads(path.read_text()).get("pid") == self.identity["pid"]:
                    path.unlink()
            except (OSError, ValueError):
                pass  # already gone or replaced: nothing of this run's to remove
        self.held = []

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def run_directories(output_dir: str, save: str | None) -> list[str]:
    """The directories a training run writes into and locks."""
    return [output_dir] + ([save] if save else [])
