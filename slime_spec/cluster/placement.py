"""GPU placement: one Ray placement group for the whole run, its bundles sorted by (node IP, GPU id), as slime does.

The driver reserves one-GPU bundles once: max(actor GPUs, rollout GPUs) with `--colocate` (train rank i and
rollout GPU i share bundle i), actor + rollout GPUs otherwise (the actor's first). Ray returns bundles in no
useful order, so a probe task per bundle reports its (node IP, GPU id) and every consumer reads the bundles
sorted: train ranks are consecutive on a node, and an engine's GPUs are consecutive bundles of one node.
Inside a bundle, train actors take `TRAIN_GPU_FRACTION` and engine actors `ENGINE_GPU_FRACTION` of the GPU,
so colocated actors share it instead of asking Ray for a second whole GPU. Placement that cannot be satisfied
fails after `--placement-timeout` seconds naming what was requested and what the cluster has, rather than hang
(0: no bound, for an autoscaling cluster that adds nodes for a pending group).
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime_spec.cluster.gpu_check import layout

PLACEMENT_TIMEOUT_S = 300.0  # --placement-timeout's default
PROGRESS_EVERY_S = 30.0
TRAIN_GPU_FRACTION = 0.4
ENGINE_GPU_FRACTION = 0.2
BUNDLE = {"GPU": 1, "CPU": 1}


@dataclass(frozen=True)
class Assignment:
    """Which placement-group bundles each consumer uses (indices into the group as Ray created it)."""

    actor_bundles: tuple[int, ...]  # one per train rank
    engine_bundles: tuple[tuple[int, ...], ...]  # one tuple per engine; its actor lives on the first
    engine_gpus: tuple[tuple[int, ...], ...]  # the GPU ids of those bundles on their node
    engine_nodes: tuple[str, ...]


@dataclass(frozen=True)
class Placement:
    """The run's placement group and its assignment; picklable, handed to the trainer and the rollout manager."""

    group: object  # ray.util.placement_group.PlacementGroup
    assignment: Assignment


def node_key(node: str) -> tuple:
    """Numeric order for IP addresses (10.0.0.9 before 10.0.0.10), then any other name as text."""
    try:
        return (0, int(ipaddress.ip_address(node)))
    except ValueError:
        return (1, node)


def sorted_bundles(locations: list[tuple[str, int]]) -> list[int]:
    """Bundle indices ordered by (node IP, GPU id); `locations[b]` is where bundle b landed."""
    return sorted(range(len(locations)), key=lambda b: (node_key(locations[b][0]), locations[b][1]))


def assign(locations: list[tuple[str, int]], *, actor_gpus: int, rollout_gpus: int, gpus_per_engine: int,
           colocate: bool) -> Assignment:
    """Train ranks and engines onto bundles: both read the (node, GPU)-sorted order; each engine takes
    `gpus_per_engine` consecutive bundles of one node, never a span across nodes."""
    num_bundles, offset = layout(actor_gpus, rollout_gpus, colocate)
    if len(locations) != num_bundles:
        raise ValueError(f"expected {num_bundles} bundle locations, got {len(locations)}")
    if gpus_per_engine < 1 or rollout_gpus % gpus_per_engine:
        raise ValueError(f"--rollout-num-gpus={rollout_gpus} is not a multiple of --rollout-num-gpus-per-engine="
                         f"{gpus_per_engine}")
    order = sorted_bundles(locations)
    rollout = order[offset:offset + rollout_gpus]
    engines: list[tuple[int, ...]] = []
    run: list[int] = []
    for b in rollout:  # consecutive runs of one node, cut into engines
        if run and locations[run[0]][0] != locations[b][0]:
            raise _span_error(locations, rollout, gpus_per_engine)
        run.append(b)
        if len(run) == gpus_per_engine:
            engines.append(tuple(run))
            run = []
    if run:
        raise _span_error(locations, rollout, gpus_per_engine)
    return Assignment(actor_bundles=tuple(order[:actor_gpus]), engine_bundles=tuple(engines),
                      engine_gpus=tuple(tuple(locations[b][1] for b in e) for e in engines),
                      engine_nodes=tuple(locations[e[0]][0] for e in engines))


def _span_error(locations, rollout: list[int], gpus_per_engine: int) -> ValueError:
    per_node: dict[str, int] = {}
    for b in rollout:
        per_node[locations[b][0]] = per_node.get(locations[b][0], 0) + 1
    return ValueError(
        f"an engine of --rollout-num-gpus-per-engine={gpus_per_engine} GPUs would span nodes: the rollout's GPUs "
        f"per node are {per_node}. One engine's GPUs must be on one node: make each node's rollout GPU count a "
        "multiple of --rollout-num-gpus-per-engine (e.g. --actor-num-gpus-per-node a multiple of it, or --colocate)")


def create_placement(*, actor_gpus: int, rollout_gpus: int, gpus_per_engine: int, colocate: bool,
                     timeout_s: float = PLACEMENT_TIMEOUT_S) -> Placement:
    """Reserve the bundles (failing after `timeout_s`; 0 waits without bound), probe where each landed, and
    assign them."""
    num_bundles, _ = layout(actor_gpus, rollout_gpus, colocate)
    if num_bundles < 1:
        raise ValueError("nothing to place: no actor GPUs and no rollout GPUs")
    group = placement_group([dict(BUNDLE)] * num_bundles, strategy="PACK")
    try:
        _wait_placed(group, num_bundles, actor_gpus, rollout_gpus, colocate, timeout_s)
        locations = ray.get([_bundle_location.options(scheduling_strategy=_in_bundle(group, b)).remote()
                             for b in range(num_bundles)], timeout=timeout_s or None)
        assignment = assign([(node, gpu) for node, gpu in locations], actor_gpus=actor_gpus,
                            rollout_gpus=rollout_gpus, gpus_per_engine=gpus_per_engine, colocate=colocate)
    except BaseException:
        remove_placement_group(group)
        raise
    for rank, b in enumerate(assignment.actor_bundles):
        print(f"[placement] train rank {rank}: bundle {b} on {locations[b][0]} GPU {locations[b][1]}", flush=True)
    for i, (node, gpus) in enumerate(zip(assignment.engine_nodes, assignment.engine_gpus)):
        print(f"[placement] engine {i}: bundles {list(assignment.engine_bundles[i])} on {node} GPUs {list(gpus)}",
              flush=True)
    return Placement(group, assignment)


def gpus_to_place(config) -> tuple[int, int]:
    """(actor GPUs, rollout GPUs) a run of `config` reserves: no trainer with --debug-rollout-only, no engine
    with --debug-train-only, and engines unplaced without --rollout-num-gpus."""
    c = config.cluster
    actor = 0 if config.debug_rollout_only else c.actor_num_nodes * c.actor_num_gpus_per_node
    rollout = 0 if (config.debug_train_only or config.rollout.load_debug_rollout_data) else (c.rollout_num_gpus or 0)
    return actor, rollout


def place_run(config) -> Placement | None:
    """The driver's one placement group for a run (waiting at most `--placement-timeout` s); None on a cluster
    without GPUs (CPU actors, unplaced)."""
    actor, rollout = gpus_to_place(config)
    if not ray.cluster_resources().get("GPU", 0) or not (actor or rollout):
        return None
    return create_placement(actor_gpus=actor, rollout_gpus=rollout,
                            gpus_per_engine=config.cluster.rollout_num_gpus_per_engine,
                            colocate=config.cluster.colocate, timeout_s=config.cluster.placement_timeout)


def engines_to_start(config, placement: Placement | None) -> int:
    """Engines a run starts: on GPUs as many as its placement holds (--rollout-num-gpus /
    --rollout-num-gpus-per-engine), whatever the backend, as --rollout-num-engines counts engines only on machines
    without GPUs; without a placement, `config.num_engines`."""
    return len(placement.assignment.engine_bundles) if placement is not None else config.num_engines


def remove_placement(placement: Placement | None) -> None:
    if placement is not None:
        remove_placement_group(placement.group)


def in_bundle(placement: Placement, bundle: int):
    """The scheduling strategy that puts an actor or task into one bundle of the run's group."""
    return _in_bundle(placement.group, bundle)


def beside_engine(placement: Placement | None, engine: int = 0) -> tuple[dict, list[int] | None]:
    """Ray options and GPU ids for another engine server on engine `engine`'s GPUs (the speed-up measurement's): in
    that engine's first bundle, asking Ray for no GPU, with the GPU ids to bind given explicitly. Ray 2.60 leaves
    CUDA_VISIBLE_DEVICES as the node has it for an actor that asks for no GPU, so such a server would otherwise
    start on the node's GPU 0. Without a placement (CPU engines): no options, no GPU ids."""
    if placement is None or not placement.assignment.engine_bundles:
        return {}, None
    a = placement.assignment
    return {"scheduling_strategy": in_bundle(placement, a.engine_bundles[engine][0])}, list(a.engine_gpus[engine])


def _in_bundle(group, bundle: int):
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)


def _wait_placed(group, num_bundles: int, actor_gpus: int, rollout_gpus: int, colocate: bool,
                 timeout_s: float) -> None:
    start = time.monotonic()
    ready = group.ready()
    deadline = start + timeout_s if timeout_s else float("inf")
    while not ray.wait([ready], timeout=max(0.1, min(PROGRESS_EVERY_S, deadline - time.monotonic())))[0]:
        waited = time.monotonic() - start
        total, free = ray.cluster_resources(), ray.available_resources()
        mode = "colocated: max of the two" if colocate else "separate: their sum"
        what = (f"{num_bundles} bundles of {BUNDLE} (--actor-num-nodes x --actor-num-gpus-per-node = {actor_gpus} "
                f"actor GPUs, --rollout-num-gpus = {rollout_gpus}; {mode})")
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the placement group of {what} was not placed within {timeout_s:.0f} s (--placement-timeout). "
                f"The cluster has GPU={total.get('GPU', 0):g} CPU={total.get('CPU', 0):g} in all; available now: "
                f"{dict(sorted(free.items()))}. Fix: lower --actor-num-gpus-per-node / --rollout-num-gpus, use "
                "--colocate, free the GPUs other jobs hold, or add nodes")
        bound = f"of {timeout_s:.0f} s" if timeout_s else "(no --placement-timeout)"
        print(f"[placement] waiting for {what} ({waited:.0f} s {bound}); cluster GPU="
              f"{total.get('GPU', 0):g}, available GPU={free.get('GPU', 0):g}", flush=True)


@ray.remote(num_cpus=0, num_gpus=0.01)
def _bundle_location() -> tuple[str, int]:
    """(node IP, GPU id) of the bundle this probe task runs in."""
    ids = ray.get_gpu_ids()
    if len(ids) != 1:
        raise RuntimeError(f"expected one GPU per placement bundle, Ray gave {ids}")
    return ray.util.get_node_ip_address(), int(ids[0])
