"""`EngineFleet`: the one owner of a manager's engines: placement, routing, restart, and the weight fence.

Routing: least-loaded with a per-engine in-flight cap (`--sglang-server-concurrency`).

Restart and the weight fence. A restarted server loads `--hf-checkpoint`, not the policy the trainer
has reached, and it has left the distributed weight-update group. So an engine that restarts while
the run is past its first sync is *fenced*: never routed to until the trainer has re-formed the group
and pushed the current weights into it (`engines_needing_sync` -> the driver has the trainer resync ->
`confirm_weights(version)`, which reads each engine's reported `weight_version` and lifts the fence only
where it equals the current one). Each Sample records the version it was generated with, so a sample
of any other version is visible and excluded (`stale_samples`), never trained on silently.

Liveness. An engine is restarted when a request to it fails unreachable, and whenever the driver asks
(`check_engines`: at every phase boundary and every few seconds while a rollout, an eval or a sync runs): its
process exited, or its probe (`Engine.liveness_problem`: SGLang's /ping, or one token generated where it should
be serving) went unanswered past a bound, as a hung (stopped) server's does; and when a failed sync names it stuck in
its broken broadcast (`restart_stuck`), which no probe sees.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from pathlib import Path
from urllib.parse import urlparse

import ray

from slime_spec.cluster.placement import ENGINE_GPU_FRACTION, Placement, create_placement, in_bundle, remove_placement
from slime_spec.common.net import free_ports
from slime_spec.config.run_config import EngineConfig
from slime_spec.fleet.actor import EngineActor

# What an engine serves right after start when it does not report a weight_version: the checkpoint.
CHECKPOINT = "checkpoint"


# Each engine's full server command line, one line per engine, in the engines' log dir.
COMMANDS_FILE = "engine_commands.txt"


def write_commands(log_dir: str | Path, commands: list[list[str]]) -> Path:
    """The engines' command lines (~400 characters each) into `log_dir`/COMMANDS_FILE; returns its path."""
    path = Path(log_dir) / COMMANDS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"engine {i}: {shlex.join(argv)}\n" for i, argv in enumerate(commands)))
    return path


def ready_line(engine: EngineConfig, urls: list[str], version: str | None, commands_path: Path) -> str:
    """The one console line for the started engines: backend, speculative algorithm, TP, ports, the file."""
    args = engine.server_args
    algorithm = args.get("speculative_algorithm") or "no speculative decoding"
    tp = engine.num_gpus_per_engine // int(args.get("pp_size") or 1)
    ports = ", ".join(str(urlparse(u).port) for u in urls)
    hosts = sorted({urlparse(u).hostname for u in urls})
    return (f"[fleet] {len(urls)} engine(s) ready ({engine.backend}, {algorithm}, tp {tp}) on {', '.join(hosts)} "
            f"ports {ports}, weights {version!r}; command lines: {commands_path}")


class NoEngineAvailable(RuntimeError):
    pass


def pick_engine(in_flight: list[int], available: list[bool], cap: int, requests: int = 1) -> int | None:
    """The available engine with the fewest in-flight requests that has room for `requests` more under `cap` (an idle
    one always has; lowest index on ties), or None."""
    candidates = [i for i, (n, ok) in enumerate(zip(in_flight, available)) if ok and (n + requests <= cap or n == 0)]
    return min(candidates, key=lambda i: in_flight[i]) if candidates else None


class Router:
    """Least-loaded routing; an unavailable engine (restarting, fenced) is waited for, a dead one skipped."""

    def __init__(self, num_engines: int, max_concurrency: int):
        if max_concurrency < 1:
            raise ValueError(f"--sglang-server-concurrency={max_concurrency}: must be >= 1")
        self.cap = max_concurrency
        self.in_flight = [0] * num_engines
        self.available = [True] * num_engines
        self.dead = [False] * num_engines  # could not be restarted: never used again
        self._group_waiters = 0  # acquire() calls for more than one request now waiting
        self._cond = asyncio.Condition()

    async def acquire(self, requests: int = 1) -> int:
        """An engine for `requests` requests (a group's batched /generate counts each of its inputs)."""
        async with self._cond:
            while True:
                if all(self.dead):
                    raise NoEngineAvailable("every rollout engine is down and could not be restarted; "
                                            "see the engine logs and run `slime-spec doctor`")
                idx = pick_engine(self.in_flight, self.available, self.cap, requests)
                if idx is not None:
                    self.in_flight[idx] += requests
                    return idx
                self._group_waiters += requests > 1
                try:
                    await self._cond.wait()
                finally:
                    self._group_waiters -= requests > 1

    async def release(self, idx: int, requests: int = 1) -> None:
        async with self._cond:
            self.in_flight[idx] -= requests
            if requests == 1 and not self._group_waiters:
                self._cond.notify(1)  # one slot freed: wake one waiter, not all (no thundering herd)
            else:  # the one woken might be a group that does not fit yet while a single request would
                self._cond.notify_all()

    async def set_available(self, idx: int, ok: bool, dead: bool = False) -> None:
        async with self._cond:
            self.available[idx] = ok and not dead
            self.dead[idx] = dead
            self._cond.notify_all()


class EngineFleet:
    """Engine actors of one RolloutManager; built in its constructor, then driven from its event loop."""

    def __init__(self, engine: EngineConfig, num_engines: int, *, max_concurrency: int, log_dir: str,
                 start_timeout_s: float, rollout_num_gpus: int = 0, placement: Placement | None = None):
        if num_engines < 1:
            raise ValueError(f"num_engines={num_engines}: need at least one rollout engine")
        self.engine_cfg, self.num_engines = engine, num_engines
        self._kwargs = dict(log_dir=log_dir, start_timeout_s=start_timeout_s)
        # one NCCL port per engine, distinct, kept across restarts (as slime allocates them)
        self.nccl_ports = free_ports(num_engines)
        self.actors: list = []
        self._own_placement = None
        try:
            if placement is not None or rollout_num_gpus:
                self._launch_gpu_engines(rollout_num_gpus, placement)
            else:
                self.actors = [EngineActor.options(num_cpus=0).remote(engine, i, nccl_port=self.nccl_ports[i],
                                                                      **self._kwargs)
                               for i in range(num_engines)]
        except BaseException:
            self.stop_blocking()
            raise
        self.router = Router(num_engines, max_concurrency)
        self.urls: list[str] = []
        self.generation = [0] * num_engines  # bumped on every restart of an engine
        self.total_restarts = 0
        self.current_version: str | None = None  # the weights the trainer holds (what every engine must serve)
        self.served: list[str | None] = [None] * num_engines  # what each engine reports it serves
        self.needs_sync: set[int] = set()
        self.stopping = False  # set by shutdown: a request failing on a stopped engine restarts nothing
        self._locks: list[asyncio.Lock] | None = None

    def wait_ready(self) -> None:
        """Block until every engine serves (an EngineStartError with its log tail surfaces here)."""
        # Blocking gets are intended here (the manager's constructor has no event loop to yield to).
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
        self.urls = ray.get([a.get_url.remote() for a in self.actors])
        self.served = [v or CHECKPOINT for v in ray.get([a.weight_version.remote() for a in self.actors])]
        self.current_version = self.served[0]
        for i, v in enumerate(self.served):
            if v != self.current_version:
                raise RuntimeError(f"engines started on different weight versions {self.served}: start every "
                                   "engine with the same --sglang-weight-version")
        path = write_commands(self._kwargs["log_dir"], ray.get([a.command.remote() for a in self.actors]))
        print(ready_line(self.engine_cfg, self.urls, self.current_version, path), flush=True)

    def _launch_gpu_engines(self, rollout_num_gpus: int, placement: Placement | None) -> None:
        """Engine i on its bundles of the run's placement (the driver's, or one of its own when started alone):
        its actor takes a fraction of its first bundle's GPU, its server sees all of its bundles' GPUs."""
        per_engine = self.engine_cfg.num_gpus_per_engine
        if placement is None:
            if rollout_num_gpus % per_engine or rollout_num_gpus // per_engine != self.num_engines:
                raise ValueError(f"--rollout-num-gpus={rollout_num_gpus} must be num_engines={self.num_engines} x "
                                 f"--rollout-num-gpus-per-engine={per_engine}")
            placement = self._own_placement = create_placement(actor_gpus=0, rollout_gpus=rollout_num_gpus,
                                                        gpus_per_engine=per_engine, colocate=False)
        a = placement.assignment
        if len(a.engine_bundles) != self.num_engines:
            raise ValueError(f"the placement holds {len(a.engine_bundles)} engine(s) of {per_engine} GPU(s) "
                             f"(--rollout-num-gpus / --rollout-num-gpus-per-engine) but {self.num_engines} engine(s) "
                             "are to start: with --rollout-backend embedded set --rollout-num-engines to "
                             "--rollout-num-gpus / --rollout-num-gpus-per-engine")
        for i, (bundles, gpus) in enumerate(zip(a.engine_bundles, a.engine_gpus)):
            self.actors.append(
                EngineActor.options(num_cpus=0, num_gpus=ENGINE_GPU_FRACTION,
                                    scheduling_strategy=in_bundle(placement, bundles[0]))
                .remote(self.engine_cfg, i, gpu_ids=list(gpus), nccl_port=self.nccl_ports[i], **self._kwargs))

    # ---- routing ----
    def lock(self, idx: int) -> asyncio.Lock:
        if self._locks is None:  # created on the event loop that uses them
            self._locks = [asyncio.Lock() for _ in range(self.num_engines)]
        return self._locks[idx]

    def version_of(self, idx: int) -> str | None:
        return self.served[idx]

    def live(self) -> list[int]:
        return [i for i in range(self.num_engines) if not self.router.dead[i]]

    # ---- restart and the fence ----
    async def recover(self, idx: int, generation: int, generate: bool = False, stuck: str | None = None) -> bool:
        """Restart engine `idx` if it died or hangs (only the first failure of an engine generation does this);
        a restarted engine that does not serve the current weights stays fenced until `confirm_weights`.
        `generate`: the engine should be serving, so it must generate a token (`Engine.liveness_problem`).
        `stuck`: the caller found it stuck (why, in words), so it is restarted whatever its probe says.
        Returns whether it was restarted."""
        async with self.lock(idx):
            if self.stopping:
                await self.router.set_available(idx, False, dead=True)
                return False
            if self.generation[idx] != generation or self.router.dead[idx]:
                return False
            await self.router.set_available(idx, False)
            try:
                restarted = await self.actors[idx].ensure_alive.remote(generate, stuck)
                version = (await self.actors[idx].weight_version.remote() or CHECKPOINT) if restarted \
                    else self.served[idx]
            except ray.exceptions.RayError as e:  # the restart failed (EngineStartError) or the actor is gone
                self.generation[idx] += 1
                print(f"[fleet] engine {idx} could not be restarted; routing around it:\n{e}", flush=True)
                await self.router.set_available(idx, False, dead=True)
                return False
            if restarted:
                self.generation[idx] += 1
                self.total_restarts += 1
                self.urls[idx] = await self.actors[idx].get_url.remote()
                self.served[idx] = version
                print(f"[fleet] engine {idx} was restarted ({restarted}): {self.urls[idx]}", flush=True)
            if self.served[idx] != self.current_version:
                if restarted or idx not in self.needs_sync:
                    print(f"[fleet] engine {idx} serves weights {self.served[idx]!r}, the policy is at "
                          f"{self.current_version!r}: fenced until the trainer re-syncs it", flush=True)
                self.needs_sync.add(idx)
                return bool(restarted)
            await self.router.set_available(idx, True)
            return bool(restarted)

    async def check_engines(self, generate: bool = False) -> list[int]:
        """Every engine's liveness now (`recover` on each; one being restarted already is left to that):
        a dead or hung engine is restarted and fenced until the trainer re-syncs it. Returns the engines
        restarted. `generate` only where the engines should be serving (not paused, memory not released)."""
        live = [i for i in self.live() if not self.lock(i).locked()]
        restarted = await asyncio.gather(*[self.recover(i, self.generation[i], generate) for i in live])
        return [i for i, r in zip(live, restarted) if r]

    async def restart_stuck(self, urls: list[str], why: str) -> list[int]:
        """Restart the engines at `urls`, found stuck where no probe sees it (SGLang's /ping answers while the
        scheduler is blocked in a broken collective); fenced like any restarted engine. Returns those restarted."""
        stuck = [i for i in self.live() if self.urls[i] in set(urls)]
        restarted = await asyncio.gather(*[self.recover(i, self.generation[i], stuck=why) for i in stuck])
        return [i for i, r in zip(stuck, restarted) if r]

    def engines_needing_sync(self) -> list[int]:
        return sorted(self.needs_sync)

    async def confirm_weights(self, version: str) -> list[int]:
        """After a sync of `version` into every engine: record what each engine reports it serves and lift
        the fence where that is `version`; returns the engines that still need a sync."""
        self.current_version = version
        for i in self.live():
            if self.lock(i).locked():  # being restarted: its recovery compares with the new version
                continue
            try:
                reported = await self.actors[i].weight_version.remote()
            except ray.exceptions.RayError as e:
                print(f"[fleet] engine {i}: reading its weight version failed: {e}", flush=True)
                reported = CHECKPOINT
            # a server too old to report weight_version: the sync that just succeeded is all we know
            self.served[i] = version if reported is None else reported
            ok = self.served[i] == version
            (self.needs_sync.discard if ok else self.needs_sync.add)(i)
            await self.router.set_available(i, ok)
        return self.engines_needing_sync()

    # ---- every engine at once ----
    async def call_all(self, method: str, *args) -> list:
        return await asyncio.gather(*[getattr(a, method).remote(*args) for a in self.actors])

    async def shutdown(self) -> None:
        """Stop every engine server; safe to call twice. Requests still in flight fail and restart nothing."""
        self.stopping = True
        results = await asyncio.gather(*[a.shutdown.remote() for a in self.actors], return_exceptions=True)
        self._release(results)

    def stop_blocking(self) -> None:
        """`shutdown` for a constructor's failure path (no event loop running yet)."""
        self.stopping = True
        results = []
        for ref in [a.shutdown.remote() for a in self.actors]:
            try:
                results.append(ray.get(ref, timeout=60))
            except (ray.exceptions.RayError, TimeoutError) as e:
                results.append(e)
        self._release(results)

    def _release(self, stop_results: list) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        remove_placement(self._own_placement)  # only a placement this fleet created; the driver removes its own
        self._own_placement = None
        gone = [r for r in stop_results if isinstance(r, BaseException)]
        if gone:  # an actor that died took its server with it (PR_SET_PDEATHSIG); say so, do not hide it
            print(f"[fleet] shutdown: {len(gone)} engine actor(s) were already gone: {str(gone[0])[:300]}",
                  flush=True)
