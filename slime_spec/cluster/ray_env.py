"""How the driver joins Ray: the `ray.init` arguments, as a pure function of the environment.

Inside `ray job submit` the job already carries a runtime env (scripts/common.sh sets one with
`--runtime-env-json`). Ray refuses to merge it with a `ray.init(runtime_env=...)` that names any of
the same fields or environment variables, even with equal values ("Failed to merge the Job's runtime
env ..."), so the driver passes only what the job's env lacks. Without an address the driver starts a
private Ray bound to the loopback address, with no dashboard: nothing listens on the network.

Loopback in Ray 2.60: `ray.init(_node_ip_address="127.0.0.1")` alone is not enough on Linux, because
`services.resolve_ip_for_localhost` replaces a loopback address with the node's routable IP whenever
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` is true (its default off macOS/Windows), and every Ray server binds
all interfaces unless the node IP is 127.0.0.1 (gcs_server, raylet, workers, the dashboard and runtime-env
agents). With that variable 0, Ray runs as it does on a laptop: node IP 127.0.0.1, every listener on loopback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

# What Ray sets in a job's driver process: the job config, its runtime env included.
JOB_CONFIG_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
# Ray's local-only mode (see the module docstring): read by the driver and inherited by every Ray process.
LOOPBACK_ONLY_ENV_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Runs in every Ray worker before any task: the same warning filters as the driver's.
WORKER_SETUP_HOOK = "slime_spec.common.logging_setup.quiet_known_noise"


def job_runtime_env(environ: Mapping[str, str]) -> dict | None:
    """The runtime env of the `ray job submit` this process runs in, or None outside a job."""
    raw = environ.get(JOB_CONFIG_ENV_VAR)
    if not raw:
        return None
    return dict(json.loads(raw).get("runtime_env") or {})


def wanted_runtime_env(environ: Mapping[str, str]) -> dict:
    """What every worker needs: unbuffered output, no hub downloads, the driver's wandb mode if set."""
    env_vars = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": environ.get("HF_HUB_OFFLINE", "1")}
    if environ.get("WANDB_MODE"):
        env_vars["WANDB_MODE"] = environ["WANDB_MODE"]
    return {"env_vars": env_vars, "worker_process_setup_hook": WORKER_SETUP_HOOK}


def runtime_env_for_init(job_runtime_env: dict | None, wanted: dict) -> dict | None:
    """`wanted` less every field and environment variable the job already sets; None when nothing is left.

    Outside a job (`job_runtime_env` None) this is `wanted` itself. The job's values win: they are what
    the person submitting asked for, and Ray would refuse the overlap anyway.
    """
    if job_runtime_env is None:
        return dict(wanted) or None
    out = {k: v for k, v in wanted.items() if k != "env_vars" and k not in job_runtime_env}
    have = job_runtime_env.get("env_vars") or {}
    missing = {k: v for k, v in (wanted.get("env_vars") or {}).items() if k not in have}
    if missing:
        out["env_vars"] = missing
    return out or None


def ray_init_kwargs(environ: Mapping[str, str], cpu_count: int | None) -> dict:
    """Arguments for `ray.init`: join RAY_ADDRESS when set (a job, or a cluster the user started),
    else a private local Ray on 127.0.0.1, never some other cluster that happens to be running."""
    runtime_env = runtime_env_for_init(job_runtime_env(environ), wanted_runtime_env(environ))
    kwargs: dict = {"log_to_driver": True}
    if runtime_env is not None:
        kwargs["runtime_env"] = runtime_env
    if not starts_private_ray(environ):
        return {"address": environ["RAY_ADDRESS"], **kwargs}
    return {"address": "local", "num_cpus": max(2, cpu_count or 2), "include_dashboard": False,
            "_node_ip_address": "127.0.0.1", **kwargs}


def starts_private_ray(environ: Mapping[str, str]) -> bool:
    """Whether `ray_init_kwargs` starts a private local Ray (no RAY_ADDRESS to join)."""
    return not environ.get("RAY_ADDRESS")


def pin_private_ray_to_loopback(environ: dict) -> None:
    """Before a private `ray.init`: Ray's local-only mode, so the node IP is 127.0.0.1 and nothing listens
    beyond loopback. Sets the variable for the Ray processes about to start, and Ray's already-imported
    constant for this process (it is read once, at import)."""
    from ray._private import ray_constants

    environ[LOOPBACK_ONLY_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
