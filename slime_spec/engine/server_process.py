"""Launch `python -m slime_spec.engine` as a child process and wait until it serves (tests, bench, demo)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import requests
from slime_spec.net import free_port




class ServerProcess:
    """One embedded server on 127.0.0.1:<port>; `url` is its base URL. Use as a context manager.

    Readiness means: this process is alive, /health answers 200 and /get_model_info names this model, so a
    server of someone else's that took the port first is never mistaken for ours. With no port given, a
    server that exits before serving (its port was taken meanwhile) is restarted on another port, twice.
    """

    def __init__(self, model_path: str | Path, extra_args: list[str] = (), port: int | None = None,
                 log_path: str | Path | None = None, timeout_s: float = 120.0, wait: bool = True):
        self.model_path, self.extra_args = str(model_path), list(extra_args)
        self.fixed_port = port
        self.log_path = Path(log_path) if log_path else None
        key = self.extra_args[self.extra_args.index("--api-key") + 1] if "--api-key" in self.extra_args else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._launch()
        if wait:
            self.wait(timeout_s)

    def _launch(self) -> None:
        self.port = self.fixed_port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "slime_spec.engine", "--model-path", self.model_path, "--host", "127.0.0.1",
               "--port", str(self.port), *self.extra_args]
        log = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})

    def wait(self, timeout_s: float = 120.0) -> "ServerProcess":
        """Block until this server serves (start several with wait=False, then wait on each)."""
        deadline = time.monotonic() + timeout_s
        restarts = 0 if self.fixed_port else 2
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if restarts:
                    restarts -= 1
                    self._launch()
                    continue
                raise RuntimeError(f"the embedded server exited with code {self.proc.returncode} before serving"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            if self._serving():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the embedded server did not serve {self.url} within {timeout_s} s")

    def _serving(self) -> bool:
        try:
            if requests.get(f"{self.url}/health", timeout=1).status_code != 200:
                return False
            info = requests.get(f"{self.url}/get_model_info", headers=self.headers, timeout=5)
        except requests.ConnectionError:
            return False
        return info.status_code == 200 and info.json().get("model_path") == self.model_path

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
