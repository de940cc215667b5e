"""Launch `python -m slime_spec.engine` as a child process and wait until it serves (tests, bench, demo)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One embedded server on 127.0.0.1:<port>; `url` is its base URL. Use as a context manager."""

    def __init__(self, model_path: str | Path, extra_args: list[str] = (), port: int | None = None,
                 log_path: str | Path | None = None, timeout_s: float = 120.0, wait: bool = True):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else None
        cmd = [sys.executable, "-m", "slime_spec.engine", "--model-path", str(model_path), "--host", "127.0.0.1",
               "--port", str(self.port), *extra_args]
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        if wait:
            self.wait(timeout_s)

    def wait(self, timeout_s: float = 120.0) -> "ServerProcess":
        """Block until /health answers 200 (start several servers with wait=False, then wait on each)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the embedded server exited with code {self.proc.returncode} before serving"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the embedded server did not serve {self.url}/health within {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
