"""`Engine`: one engine server process and its control routes; `EngineActor` is the same class as a Ray actor.

The rollout's /generate traffic goes straight to `url` (fleet/client.py `AsyncEngineClient`); this class
owns the process (start, health, restart, stop) and the control routes, each a thin POST over SGLang's
native HTTP API, so it works unchanged against `sglang.launch_server` and the embedded engine. Payloads are
SGLang's io_struct fields (`slime_spec.fleet.sglang_contract`); failures raise `EngineError`.
Engine i starts with `--random-seed seed + i`, so the samples of one GRPO group differ across engines.
From Ray, call `get_url()` (`url` is a property).
"""

from __future__ import annotations

import atexit
import time
from pathlib import Path

import ray

from slime_spec.config.run_config import EngineConfig
from slime_spec.fleet.client import EngineAuth, EngineClient, EngineError, weight_version_of
from slime_spec.fleet.process import ServerProcess, engine_server_process

DEFAULT_START_TIMEOUT_S = 1800.0
# As slime before a release: /flush_cache answers 400 while requests run or wait (SGLang flushes only an idle
# engine, and asserts idleness in release_memory_occupation), so it is retried until the engine is idle.
FLUSH_ATTEMPTS, FLUSH_RETRY_S = 60, 1.0


def with_nccl_port(argv: list[str], port: int | None) -> list[str]:
    """`--nccl-port port` for the server unless the flags already give one (`--sglang-nccl-port`): SGLang otherwise
    picks a random port per server, and engines on one node may pick the same one."""
    if port is None or "--nccl-port" in argv:
        return list(argv)
    return [*argv, "--nccl-port", str(port)]


class Engine:
    def __init__(self, engine: EngineConfig, index: int, *, log_dir: str, host: str | None = None,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S, gpu_ids: list[int] | None = None,
                 nccl_port: int | None = None):
        self.index, self.start_timeout_s = index, start_timeout_s
        self.restarts = 0
        self.stopped = False  # set by shutdown: no restart may bring the server back after it
        self.process: ServerProcess = engine_server_process(
            engine, log_path=Path(log_dir) / f"engine_{index}.log", host=host or node_host(), gpu_ids=gpu_ids,
            engine_index=index)
        self.process.argv = with_nccl_port(self.process.argv, nccl_port)  # the same port on every restart
        atexit.register(self.shutdown)
        self.process.start(start_timeout_s)
        # after the start: a port taken meanwhile moves the server to another one (ServerProcess.port_retries)
        self.client = EngineClient(self.process.url, EngineAuth.from_server_args(engine.server_args))

    # ---- lifecycle ----
    @property
    def url(self) -> str:
        return self.process.url

    def get_url(self) -> str:
        return self.url

    def command(self) -> list[str]:
        """The server's full command line (the fleet writes it to a file, not to the console)."""
        return list(self.process.argv)

    def pid(self) -> int | None:
        return self.process.pid

    def log_path(self) -> str:
        return str(self.process.log_path)

    def alive(self) -> bool:
        return self.process.alive()

    def restart(self) -> str:
        """Stop and start the server with the same argv (same port); returns the url."""
        if self.stopped:
            raise RuntimeError(f"engine {self.index} was shut down; it is not restarted")
        self.process.stop()
        self.process.start(self.start_timeout_s)
        self.restarts += 1
        return self.url

    def liveness_problem(self, generate: bool = False) -> str | None:
        """None while the server serves; else why not: its process exited, or it does not answer its probe
        within a bounded time (client.py `liveness_problem`: /ping, or one token generated with `generate`)."""
        if not self.process.alive():
            code = self.process.proc.returncode if self.process.proc is not None else None
            return f"its server process exited (code {code})"
        return self.client.liveness_problem(generate)

    def ensure_alive(self, generate: bool = False, stuck: str | None = None) -> str | None:
        """Restart the server if its process died or stopped answering, or if the caller found it `stuck` (why, in
        words) where no probe sees it; returns why it was restarted, None when it serves. After `shutdown` (a
        request failing because shutdown just stopped the server) it never restarts."""
        if self.stopped:
            return None
        problem = stuck or self.liveness_problem(generate)
        if problem is None:
            return None
        print(f"[engine {self.index}] {self.url}: {problem}; restarting", flush=True)
        self.restart()
        return problem

    def shutdown(self) -> int | None:
        """Stop the server and every process in its group; safe to call twice."""
        self.stopped = True
        return self.process.stop()

    # ---- control routes ----
    def post(self, path: str, payload: dict | None = None) -> dict:
        return self.client.post(path, payload)

    def server_info(self) -> dict:
        return self.client.server_info()

    def weight_version(self) -> str | None:
        """The version of the weights this engine serves, as it reports it: SGLang's `/model_info` (its
        `/server_info` is the startup configuration and keeps the version the engine started with)."""
        return weight_version_of(self.client)

    def generate(self, payload: dict) -> dict:
        return self.post("/generate", payload)

    def flush_cache(self) -> dict:
        return self.post("/flush_cache")

    def flush_cache_when_idle(self) -> dict:
        """/flush_cache until it succeeds (SGLang flushes only an idle engine: 400 while requests run or wait), at
        most FLUSH_ATTEMPTS times FLUSH_RETRY_S apart; an unreachable engine fails at once."""
        for attempt in range(1, FLUSH_ATTEMPTS + 1):
            try:
                return self.flush_cache()
            except EngineError as e:
                if e.unreachable or attempt == FLUSH_ATTEMPTS:
                    raise EngineError(e.url, e.path, e.status, f"{e.body[:500]} (the engine was not idle after "
                                      f"{FLUSH_ATTEMPTS} tries {FLUSH_RETRY_S:g} s apart)"
                                      if not e.unreachable else e.body) from e
            time.sleep(FLUSH_RETRY_S)
        raise AssertionError("unreachable")

    def pause_generation(self, mode: str = "abort") -> dict:
        return self.post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self.post("/continue_generation")

    def abort_request(self, rid: str | None = None) -> dict:
        return self.post("/abort_request", {"rid": rid} if rid else {"abort_all": True})

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Only once the engine is idle (SGLang asserts it): flushed first, with a bounded retry."""
        self.flush_cache_when_idle()
        return self.post("/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.post("/resume_memory_occupation", {"tags": tags})

    def begin_weight_update(self, selector: str = "all") -> dict:
        return self.post("/begin_weight_update", {"selector": selector})

    def end_weight_update(self) -> dict:
        return self.post("/end_weight_update")


EngineActor = ray.remote(Engine)


def node_host() -> str:
    """127.0.0.1 on a one-node Ray cluster; the node's address when engines may be reached from other nodes."""
    if ray.is_initialized() and sum(bool(n.get("Alive")) for n in ray.nodes()) > 1:
        return ray.util.get_node_ip_address()
    return "127.0.0.1"
