"""The driver's `ray.init` arguments: inside a job only what the job's runtime env lacks (Ray refuses any
overlap), outside a job a private loopback Ray."""

import json

import ray
from ray.runtime_env.runtime_env import _merge_runtime_env

from slime_spec.cluster.ray_env import (
    JOB_CONFIG_ENV_VAR,
    WORKER_SETUP_HOOK,
    job_runtime_env,
    ray_init_kwargs,
    runtime_env_for_init,
    wanted_runtime_env,
)

# What scripts/common.sh passes to `ray job submit --runtime-env-json`.
SCRIPT_JOB_ENV = {"env_vars": {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "0",
                               "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": "/repo"}}


def job_environ(runtime_env: dict, **extra) -> dict:
    return {JOB_CONFIG_ENV_VAR: json.dumps({"runtime_env": runtime_env, "metadata": {}}),
            "RAY_ADDRESS": "127.0.0.1:6379", **extra}


def test_inside_the_scripts_job_only_missing_vars_and_ray_merges_them():
    environ = job_environ(SCRIPT_JOB_ENV)
    kwargs = ray_init_kwargs(environ, 2)
    env = kwargs["runtime_env"]
    assert env["env_vars"] == {"HF_HUB_OFFLINE": "1"}  # PYTHONUNBUFFERED is the job's already
    assert env["worker_process_setup_hook"] == WORKER_SETUP_HOOK
    assert kwargs["address"] == "127.0.0.1:6379" and "_node_ip_address" not in kwargs
    # Ray's own merge (the one that raised "Failed to merge the Job's runtime env") accepts it
    merged = _merge_runtime_env(SCRIPT_JOB_ENV, env)
    assert merged is not None and merged["env_vars"]["PYTHONUNBUFFERED"] == "1"
    # ... and the old driver env, which named PYTHONUNBUFFERED again, is what it refused
    assert _merge_runtime_env(SCRIPT_JOB_ENV, {"env_vars": {"PYTHONUNBUFFERED": "1"}}) is None


def test_job_values_win_and_nothing_left_is_none():
    job = {"env_vars": {"HF_HUB_OFFLINE": "0", "PYTHONUNBUFFERED": "1"}, "worker_process_setup_hook": "x.y"}
    assert runtime_env_for_init(job, wanted_runtime_env({})) is None
    assert runtime_env_for_init({"pip": ["a"]}, {"env_vars": {"A": "1"}}) == {"env_vars": {"A": "1"}}
    assert runtime_env_for_init(None, {"env_vars": {"A": "1"}}) == {"env_vars": {"A": "1"}}


def test_wandb_mode_is_forwarded_only_when_set():
    assert "WANDB_MODE" not in wanted_runtime_env({})["env_vars"]
    assert wanted_runtime_env({"WANDB_MODE": "online"})["env_vars"]["WANDB_MODE"] == "online"


def test_outside_a_job_a_private_loopback_ray():
    assert job_runtime_env({}) is None
    kwargs = ray_init_kwargs({}, 1)
    assert kwargs["address"] == "local" and kwargs["_node_ip_address"] == "127.0.0.1"
    assert kwargs["include_dashboard"] is False and kwargs["num_cpus"] == 2
    assert kwargs["runtime_env"]["env_vars"]["PYTHONUNBUFFERED"] == "1"


def test_ray_init_accepts_these_arguments():
    """Ray 2.60's `ray.init` takes every name we pass (a typo would be an unknown-kwarg error at start-up)."""
    import inspect

    params = inspect.signature(ray.init).parameters
    known = {"address", "num_cpus", "include_dashboard", "runtime_env", "log_to_driver"}
    assert known <= set(params)
    assert "_node_ip_address" in inspect.getsource(ray._private.worker.init)


def test_a_private_ray_is_pinned_to_loopback(monkeypatch):
    """Ray 2.60 turns a loopback node IP into the routable one unless its local-only mode is on; pinned, the
    node IP Ray resolves for 127.0.0.1 stays 127.0.0.1 (so every Ray server binds loopback)."""
    from ray._private import ray_constants, services

    from slime_spec.cluster.ray_env import LOOPBACK_ONLY_ENV_VAR, pin_private_ray_to_loopback, starts_private_ray
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)
    assert starts_private_ray({}) and starts_private_ray({"RAY_ADDRESS": ""})
    assert not starts_private_ray({"RAY_ADDRESS": "127.0.0.1:6379"})
    environ: dict = {}
    pin_private_ray_to_loopback(environ)
    assert environ == {LOOPBACK_ONLY_ENV_VAR: "0"}
    assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
