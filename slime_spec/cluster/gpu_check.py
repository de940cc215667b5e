"""Requested GPUs against the GPUs there are, before any engine or trainer starts.

A reachable Ray cluster (RAY_ADDRESS; when launching, also a head already running on this machine)
is asked for its GPUs; one is never started here. Without one, the run would start its own Ray on
this machine, so this machine's CUDA devices are what counts. Only backend sglang places GPUs.
"""

from __future__ import annotations

import os

from slime_spec.config.run_config import Config
from slime_spec.doctor.codes import Finding, Rule


def layout(actor_gpus: int, rollout_gpus: int, colocate: bool) -> tuple[int, int]:
    """(GPU bundles a run reserves, index in the sorted bundles where the rollout's start): colocated, the
    trainer and the engines share max(actor, rollout) GPUs; separate, they take their sum, actor first."""
    if colocate:
        return max(actor_gpus, rollout_gpus), 0
    return actor_gpus + rollout_gpus, actor_gpus


def requested_gpus(config: Config) -> tuple[int, str]:
    """GPUs the run places (engines, plus the trainer unless --debug-rollout-only), and how they add up."""
    c = config.cluster
    rollout = config.num_engines * c.rollout_num_gpus_per_engine
    actor = 0 if config.debug_rollout_only else c.actor_num_nodes * c.actor_num_gpus_per_node
    total, _ = layout(actor, rollout, c.colocate)
    if c.colocate:
        return total, f"actor {actor} and rollout {rollout} on the same GPUs (--colocate)"
    return total, f"actor {actor} + rollout {rollout}"


def compare_gpus(requested: int, detail: str, cluster_gpus: float | None, local_gpus: int, launching: bool,
                 no_cluster_reason: str = "no Ray cluster is reachable") -> list[Finding]:
    """Pure: the finding for `requested` GPUs against a cluster's (None: no cluster) or this machine's."""
    if requested == 0:
        return []
    if cluster_gpus is not None:
        if requested > cluster_gpus:
            return [Rule.GPUS_UNAVAILABLE.finding(requested=requested, detail=detail, where="the Ray cluster",
                                                  available=f"{cluster_gpus:g}")]
        return []
    if requested <= local_gpus:
        return []
    if launching:
        return [Rule.GPUS_UNAVAILABLE.finding(requested=requested, detail=detail, where="this machine (no Ray "
                                              "cluster is reachable)", available=local_gpus or "none")]
    return [Rule.GPUS_NOT_CHECKED.finding(requested=requested, detail=detail, available=local_gpus or "none",
                                          ray=no_cluster_reason)]


def ray_address(launching: bool) -> str | None:
    """RAY_ADDRESS, else (when launching) the one head already running on this machine; None without one."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    if not launching:
        return None
    from ray._private.services import find_gcs_addresses

    found = find_gcs_addresses()
    return found[0] if len(found) == 1 else None


def ray_cluster_gpus(address: str) -> float:
    """GPUs of the running cluster at `address` (connects as a driver, then disconnects)."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0))
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return float(ray.cluster_resources().get("GPU", 0))
    finally:
        ray.shutdown()


def local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def gpu_findings(config: Config, launching: bool) -> list[Finding]:
    if config.engine.backend != "sglang":
        return []
    requested, detail = requested_gpus(config)
    if requested == 0:
        return []
    address, cluster, reason = ray_address(launching), None, "no Ray cluster is reachable"
    if address:
        try:
            cluster = ray_cluster_gpus(address)
        except (ConnectionError, RuntimeError, ValueError) as e:  # reported below, as the reason nothing was compared
            reason = f"the Ray cluster at {address} did not answer ({e})"
    return compare_gpus(requested, detail, cluster, local_gpus(), launching, reason)
