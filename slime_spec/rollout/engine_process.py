"""One engine server process: start on a free port, wait for /health, stop with its children.

Usable without Ray (tests, benchmarks). The process runs in its own session (process group),
so `stop()` kills the server and every process it forked (SGLang's scheduler and detokenizer,
the embedded engine's workers); when started from a main thread it also gets PR_SET_PDEATHSIG,
so it dies with its parent even if the parent is SIGKILLed. Its stdout and stderr go to a log
file whose tail is carried by `EngineStartError`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

import requests

from slime_spec.config import EngineConfig
from slime_spec.net import free_port

LOG_TAIL_LINES = 40


class EngineStartError(RuntimeError):
    """The server died or never became healthy; carries its exit code and the tail of its log."""

    def __init__(self, reason: str, *, argv: list[str], exit_code: int | None, log_path: Path, log_tail: str):
        self.exit_code, self.log_path, self.log_tail = exit_code, log_path, log_tail
        super().__init__(
            f"engine server {reason} (exit code {exit_code}).\n"
            f"command: {' '.join(argv)}\n"
            f"log: {log_path}\n--- last {LOG_TAIL_LINES} lines of the server log ---\n{log_tail}\n---\n"
            "Run `slime-spec doctor` with the same flags to check the speculative and engine configuration.")




def read_log_tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    if not path.exists():
        return "(no log written)"
    with path.open(errors="replace") as f:
        return "".join(deque(f, maxlen=n)).rstrip("\n")


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """A server started from a fixed argv; `start()` again after a crash reuses the same argv."""

    def __init__(self, argv: list[str], *, url: str, log_path: str | Path, env: dict | None = None):
        self.argv, self.url, self.env = list(argv), url, env
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float) -> None:
        if self.alive():
            raise RuntimeError(f"server {self.url} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        preexec = _die_with_parent if (os.name == "posix" and threading.current_thread() is threading.main_thread()
                                       and Path("/proc").exists()) else None
        with self.log_path.open("ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} starting: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True, preexec_fn=preexec)
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()  # never leave a half-started server behind, even on Ctrl-C
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last_error = "no response yet"
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self._start_error("exited before becoming healthy", code)
            try:
                r = requests.get(f"{self.url}/health", timeout=5)
                if r.status_code == 200:
                    return
                last_error = f"HTTP {r.status_code}"
            except requests.RequestException as e:  # not listening yet: keep polling until the deadline
                last_error = f"{type(e).__name__}"
            if time.monotonic() > deadline:
                self.stop()
                raise self._start_error(f"did not become healthy at {self.url}/health within {timeout_s:.0f}s "
                                        f"(last answer: {last_error})", self.proc.returncode)
            time.sleep(0.2)

    def _start_error(self, reason: str, code: int | None) -> EngineStartError:
        return EngineStartError(reason, argv=self.argv, exit_code=code, log_path=self.log_path,
                                log_tail=read_log_tail(self.log_path))

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        # Children of a server that died on its own may still be alive in its group.
        self._signal_group(signal.SIGKILL)
        self._wait_group_gone(grace_s)
        return self.proc.returncode

    def _signal_group(self, sig: int) -> bool:
        """Signal every process of the server's group; False when the group no longer exists."""
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def _wait_group_gone(self, timeout_s: float) -> None:
        """SIGKILL is asynchronous: wait until the group's last process has exited (zombies aside)."""
        deadline = time.monotonic() + timeout_s
        while self._signal_group(0) and _group_has_live_process(self.proc.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of group {self.proc.pid} ({self.argv[0]} ...) survived SIGKILL "
                                   f"for {timeout_s}s")
            time.sleep(0.02)


def _group_has_live_process(pgid: int) -> bool:
    """Whether a non-zombie process of group `pgid` exists (Linux /proc; elsewhere the signal must do)."""
    proc = Path("/proc")
    if not proc.exists():
        return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process exited while we looked
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def engine_server_process(engine: EngineConfig, *, log_path: str | Path, host: str = "127.0.0.1",
                          port: int | None = None, gpu_ids: list[int] | None = None) -> ServerProcess:
    """The server process of one engine: the argv from `EngineConfig.server_argv`, on `gpu_ids` if given."""
    port = port or free_port(host)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))} if gpu_ids else None
    return ServerProcess(engine.server_argv(host, port, base_gpu_id=0), url=f"http://{host}:{port}",
                         log_path=log_path, env=env)
