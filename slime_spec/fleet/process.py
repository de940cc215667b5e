"""One engine server process: start it, wait until it serves, stop it with every process it forked.

Used by the engine actor (SGLang or the embedded engine), the sglang-router, tests and benchmarks.
The process runs in its own session (process group), so `stop()` kills the server and its children
(SGLang's scheduler and detokenizer, the embedded engine's workers); started from a main thread it
also gets PR_SET_PDEATHSIG, so it dies with its parent even if the parent is SIGKILLed. Its stdout
and stderr go to a log file whose tail `EngineStartError` carries.

Start-up waits as long as the process is alive and not yet answering (as slime does): loading a
large TP8 checkpoint and capturing CUDA graphs can take far more than five minutes. `timeout_s`
(`--engine-start-timeout`) is only the upper bound for a server that never comes up.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import requests

from slime_spec.common.errors import StructuredError
from slime_spec.common.net import free_port
from slime_spec.config.run_config import EngineConfig
from slime_spec.fleet.client import EngineAuth, EngineClient, EngineError

LOG_TAIL_LINES = 40
PROGRESS_EVERY_S = 60.0


class EngineStartError(StructuredError):
    """The server died or never became ready; carries its exit code and the tail of its log."""

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


def _with_port(argv: list[str], port: int) -> list[str]:
    if "--port" not in argv:
        raise ValueError(f"port_retries needs a --port in the server argv: {' '.join(argv)}")
    i = argv.index("--port")
    return [*argv[:i + 1], str(port), *argv[i + 2:]]


class ServerProcess:
    """A server started from a fixed argv; `start()` again after a crash reuses the same argv and url.

    `expect_model_path`: ready also means /model_info names this model, so another server that took the
    port first is never mistaken for ours. `port_retries`: a server that exits before serving (its port
    was taken meanwhile) is relaunched on a fresh port that many times.
    """

    def __init__(self, argv: list[str], *, host: str, port: int, log_path: str | Path, env: dict | None = None,
                 expect_model_path: str | None = None, auth: EngineAuth = EngineAuth(), port_retries: int = 0):
        self.argv, self.host, self.port, self.env = list(argv), host, port, env
        self.log_path = Path(log_path)
        self.expect_model_path, self.auth, self.port_retries = expect_model_path, auth, port_retries
        self.proc: subprocess.Popen | None = None
        self._log_offset = 0  # where this launch's output starts in the (appended) log
        self._ready_path = "/ready"  # "/health" once the server answered /ready with 404 (no such route)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header of the server's API key (tests post with it)."""
        return self.auth.headers("/generate")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float | None = None) -> "ServerProcess":
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> "ServerProcess":
        """Spawn the process and return at once (start several, then `wait_ready` on each)."""
        if self.alive():
            raise RuntimeError(f"server {self.url} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        preexec = _die_with_parent if (os.name == "posix" and threading.current_thread() is threading.main_thread()
                                       and Path("/proc").exists()) else None
        with self.log_path.open("ab") as log:
            self._log_offset = log.tell()
            log.write(f"\n==== {time.strftime('%H:%M:%S')} starting: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True, preexec_fn=preexec)
        return self

    def wait_ready(self, timeout_s: float | None = None) -> "ServerProcess":
        """Wait while the process is alive and not yet serving; `timeout_s` is only an upper bound."""
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()  # never leave a half-started server behind, even on Ctrl-C
            raise
        return self

    def _wait_ready(self, timeout_s: float | None) -> None:
        start = time.monotonic()
        next_progress = start + PROGRESS_EVERY_S
        retries = self.port_retries
        last = "no answer yet"
        next_bind_check = start
        while True:
            code = self.proc.poll()
            bind_failed = False
            if code is not None or time.monotonic() >= next_bind_check:
                # SGLang's server does not exit when uvicorn cannot bind: it stays alive, warming up against
                # whatever holds the port, until --engine-start-timeout. When it has exited meanwhile, its log
                # still says why, even after the holder let the port go.
                next_bind_check = time.monotonic() + 2.0
                bind_failed = self._bind_failed()
            if code is not None or bind_failed:
                if bind_failed:
                    self.stop()
                if retries and (bind_failed or _port_taken(self.host, self.port)):  # someone else bound it first
                    retries -= 1
                    self.port = free_port(self.host)
                    self.argv = _with_port(self.argv, self.port)
                    self.launch()
                    continue
                raise self._start_error(f"could not bind {self.url} (address already in use)" if bind_failed
                                        else "exited before becoming healthy", self.proc.poll())
            last = self._probe()
            if last == "ready":
                return
            now = time.monotonic()
            if timeout_s is not None and now - start > timeout_s:
                raise self._start_error(f"did not become ready at {self.url}/ready within {timeout_s:.0f}s "
                                        f"(--engine-start-timeout; last answer: {last})", self.proc.poll())
            if now > next_progress:
                next_progress = now + PROGRESS_EVERY_S
                print(f"[engine] {self.url} still starting after {now - start:.0f}s (alive, pid {self.pid}; "
                      f"last answer: {last}; log {self.log_path})", file=sys.stderr, flush=True)
            time.sleep(0.2)

    def _bind_failed(self) -> bool:
        """This launch's log says uvicorn could not bind the server's port."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        return f"('{self.host}', {self.port}): address already in use" in text

    def _probe(self) -> str:
        """'ready', or what the server answered instead (not listening yet, 503 while loading, ...). Ready is
        SGLang's /ready: its startup and warmup generation done, not paused (/health where a server has no /ready:
        on SGLang it generates a token too, but never answers in under 1 s)."""
        try:
            r = requests.get(f"{self.url}{self._ready_path}", timeout=5)
            if r.status_code == 404 and self._ready_path == "/ready":
                self._ready_path = "/health"
                r = requests.get(f"{self.url}/health", timeout=5)
        except requests.RequestException as e:
            return type(e).__name__
        if r.status_code != 200:
            return f"HTTP {r.status_code}"
        if self.expect_model_path is None:
            return "ready"
        client = EngineClient(self.url, self.auth, read_timeout_s=30)
        try:
            try:
                info = client.get("/model_info")
            except EngineError as e:
                if e.status != 404:
                    raise
                info = client.get("/get_model_info")
        except EngineError as e:
            return f"/model_info: {e}"
        finally:
            client.close()
        if info.get("model_path") != self.expect_model_path:
            return f"another server (model {info.get('model_path')!r}) answers on this port"
        return "ready" if self.alive() else "exited"

    def _start_error(self, reason: str, code: int | None) -> EngineStartError:
        return EngineStartError(reason, argv=self.argv, exit_code=code, log_path=self.log_path,
                                log_tail=read_log_tail(self.log_path))

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; returns the exit code. Safe to call twice."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)  # a stopped (hung) process acts on SIGTERM only once continued
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        # Children of a server that died on its own may still be alive in its group.
        self._signal_group(signal.SIGKILL)
        self._wait_group_gone(grace_s)
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

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


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


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
                          port: int | None = None, gpu_ids: list[int] | None = None,
                          engine_index: int = 0) -> ServerProcess:
    """The server of one engine: `EngineConfig.server_argv` (seed + engine index), on `gpu_ids` if given."""
    retries = 0 if port else 2  # a port we chose may be taken before the server binds it: choose another
    port = port or free_port(host)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))} if gpu_ids else None
    return ServerProcess(engine.server_argv(host, port, base_gpu_id=0, engine_index=engine_index), host=host,
                         port=port, log_path=log_path, env=env, auth=EngineAuth.from_server_args(engine.server_args),
                         port_retries=retries)


def embedded_server_process(model_path: str | Path, extra_args: list[str] = (), *, log_path: str | Path,
                            port: int | None = None, env: dict | None = None) -> ServerProcess:
    """`python -m slime_spec.engine` on 127.0.0.1 (tests, benchmarks, the demo); a taken port is retried; `env`:
    variables set for the server on top of this process's."""
    extra = list(extra_args)
    auth = EngineAuth(_flag(extra, "--api-key"), _flag(extra, "--admin-api-key"))
    chosen = port or free_port()
    argv = [sys.executable, "-m", "slime_spec.engine", "--model-path", str(model_path), "--host", "127.0.0.1",
            "--port", str(chosen), *extra]
    return ServerProcess(argv, host="127.0.0.1", port=chosen, log_path=log_path, env=env,
                         expect_model_path=str(model_path), auth=auth, port_retries=0 if port else 2)


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None
