"""A Ray head that e2e runs join instead of each starting a private Ray (`python -m slime_spec.train` joins the
cluster RAY_ADDRESS names; cluster/ray_env.py).

`ray start --head --block` on loopback only (every service on a port free now, Ray's local-only mode as
cluster/ray_env.py explains), with Ray 2.60 token authentication and a temp dir of its own, in a process group of
its own: `stop` signals exactly that group, never another Ray on the machine. Runs that inspect their own
processes (tests/e2e/run_processes.py, test_engine_faults.py) keep their private Ray: a joined run's workers are
the head's children and carry none of the run's environment.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from slime_spec.cluster.ray_env import LOOPBACK_ONLY_ENV_VAR
from slime_spec.common.net import free_ports

HOST = "127.0.0.1"
START_TIMEOUT_S = 120.0


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((HOST, port)) == 0


def _group_alive(pgid: int) -> bool:
    """A live (not zombie) process in the group."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # after "comm)": state, ppid, pgrp
            return True
    return False


class RayHead:
    """One head, started by `start` and stopped by `stop`; `env` is what a driver needs to join it."""

    def __init__(self, num_cpus: int = 2):
        self.num_cpus = num_cpus
        # Ray's unix sockets live under the temp dir and must stay under ~107 characters: a short path.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ssrayh", dir="/tmp"))
        self.token = self.temp_dir / "auth_token"
        self.log = self.temp_dir / "head.log"
        self.proc: subprocess.Popen | None = None
        self.gcs_port = 0

    @property
    def env(self) -> dict[str, str]:
        return {"RAY_ADDRESS": f"{HOST}:{self.gcs_port}", "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN_PATH": str(self.token), LOOPBACK_ONLY_ENV_VAR: "0"}

    def driver_env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` less any other Ray setting, joined to this head."""
        return {**{k: v for k, v in base.items() if not k.startswith("RAY_")}, **self.env}

    def start(self) -> RayHead:
        self.token.write_text(uuid.uuid4().hex)
        gcs, node_manager, object_manager, runtime_env_agent, agent_listen, agent_grpc, metrics = free_ports(7, HOST)
        self.gcs_port = gcs
        ray_cli = Path(sys.executable).parent / "ray"
        argv = [str(ray_cli)] if ray_cli.exists() else [sys.executable, "-m", "ray.scripts.scripts"]
        argv += ["start", "--head", "--block", "--node-ip-address", HOST, "--port", str(gcs),
                 "--num-cpus", str(self.num_cpus), "--num-gpus", "0", "--disable-usage-stats",
                 "--temp-dir", str(self.temp_dir), "--include-dashboard", "false",
                 "--node-manager-port", str(node_manager), "--object-manager-port", str(object_manager),
                 "--runtime-env-agent-port", str(runtime_env_agent), "--dashboard-agent-listen-port", str(agent_listen),
                 "--dashboard-agent-grpc-port", str(agent_grpc), "--metrics-export-port", str(metrics)]
        env = self.driver_env(dict(os.environ))
        env.pop("RAY_ADDRESS")
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        # `ray start --block` prints this once the GCS and the raylet are up
        while "Ray runtime started" not in self.log.read_text(errors="replace") or not _port_open(gcs):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log_text = self.log.read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"the test Ray head did not start (exit {self.proc.returncode}):\n{log_text}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        """SIGTERM the head's process group, SIGKILL what outlives 5 s (Ray's reaper waits for its parent)."""
        if self.proc is not None:
            pgid = self.proc.pid
            for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait_s
                while _group_alive(pgid) and time.monotonic() < deadline:
                    time.sleep(0.2)
                if not _group_alive(pgid):
                    break
            self.proc.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
