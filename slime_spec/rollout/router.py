"""sglang-router in front of the engines (`--use-sglang-router`): its command line and its start."""

from __future__ import annotations

import sys
from pathlib import Path

from slime_spec.common.net import free_port
from slime_spec.fleet.process import ServerProcess

# The router's health check: SGLang answers /health (and /health_generate) by generating one token, which
# cannot answer while a weight sync has the engine paused or a colocated train step has its memory released.
# The fleet, not the router, decides an engine is dead (restart + weight fence), so the router may only mark
# an engine unhealthy after failing for longer than any such pause: ROUTER_HEALTH_FAILURES checks
# ROUTER_HEALTH_INTERVAL_S apart, and at least --engine-start-timeout (the longest an engine may take to come back).
ROUTER_HEALTH_ENDPOINT = "/health"
ROUTER_HEALTH_INTERVAL_S = 60
ROUTER_HEALTH_TIMEOUT_S = 30
ROUTER_HEALTH_OUTLAST_S = 24 * 3600  # a colocated train step of a large model may hold the engines for hours


def sglang_router_argv(python: str, port: int, worker_urls: list[str], engine_start_timeout_s: float) -> list[str]:
    """`python -m sglang_router.launch_router` on 127.0.0.1:`port` over `worker_urls`, with a health check
    that outlasts a sync or a colocated train step (see ROUTER_HEALTH_*), and recovers after one good answer."""
    outlast_s = max(ROUTER_HEALTH_OUTLAST_S, engine_start_timeout_s)
    failures = -(-int(outlast_s) // ROUTER_HEALTH_INTERVAL_S) + 1
    return [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls,
            "--health-check-endpoint", ROUTER_HEALTH_ENDPOINT,
            "--health-check-interval-secs", str(ROUTER_HEALTH_INTERVAL_S),
            "--health-check-timeout-secs", str(ROUTER_HEALTH_TIMEOUT_S),
            "--health-failure-threshold", str(failures),
            "--health-success-threshold", "1"]


def start_router(worker_urls: list[str], engine_start_timeout_s: float, log_path: Path) -> ServerProcess:
    """The router on a free port of 127.0.0.1 over `worker_urls`, started (waited for at most
    `engine_start_timeout_s`)."""
    port = free_port()
    process = ServerProcess(sglang_router_argv(sys.executable, port, worker_urls, engine_start_timeout_s),
                            host="127.0.0.1", port=port, log_path=log_path)
    process.start(engine_start_timeout_s)
    return process
