"""`python -m slime_spec.train`: rollout -> train -> sync weights, for `--num-rollout` steps.

The driver is thin: it parses the flags once, runs the speculative checks (stopping on an
error), starts a local Ray when no cluster is given, and moves samples and metrics between
the RolloutManager (engines) and the TrainGroup (Megatron actors). It knows no HTTP payload.
Modes: separate placement (default), `--colocate` (engine memory released while training; trainer and
engines share one placement group's GPUs, see placement.py; after training, in slime's order: the trainer
offloaded, the engines' weights resumed, the sync, then their CUDA graphs and KV cache),
`--debug-rollout-only` (no trainer) and `--debug-train-only` (no engines; replays saved data).
An engine restarted during a run is fenced by the fleet until the driver has the trainer re-sync it
(`generate_fenced`, `sync_all`); shutdown stops the manager even when the trainer's shutdown fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from contextlib import nullcontext
from typing import Callable

from slime_spec.common.logging_setup import quiet_known_noise
from slime_spec.common.phase_clock import PhaseClock
from slime_spec.config.args import ArgsError, parse
from slime_spec.config.run_config import Config, WandbConfig
from slime_spec.doctor.diagnose import diagnose, render_text
from slime_spec.driver.report import LoopReport
from slime_spec.speculative import speedup as spec_speedup


def preflight(argv: list[str]) -> Config:
    """Parse and check; an error finding stops the run before anything starts."""
    parsed = parse(argv)
    config, findings = diagnose(parsed, launching=True)
    errors = [f for f in findings if f.level == "error"]
    shown = [f for f in findings if f.level != "info"]
    if shown or errors:
        print(render_text(config, shown, []), flush=True)
    if errors or config is None:
        raise SystemExit(2)
    try:
        spec_speedup.check_config(config)
    except ValueError as e:
        print(f"slime-spec: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from e
    return config


def init_ray() -> bool:
    """Join Ray (RAY_ADDRESS, or the job's cluster), or start a private one; True when this call started one."""
    import ray

    from slime_spec.cluster import private_ray
    from slime_spec.cluster.ray_env import ray_init_kwargs, starts_private_ray
    if ray.is_initialized():
        return False
    if starts_private_ray(os.environ):  # loopback only, and stopped even if this driver is SIGKILLed
        private_ray.start()
    else:  # inside a job: only what the job's runtime env lacks (see cluster/ray_env.py)
        ray.init(**ray_init_kwargs(os.environ, os.cpu_count()))
    exit_on_sigterm()  # ray.init installs its own SIGTERM handler (it aborts): SIGTERM must unwind instead
    return private_ray.running()


def stop_private_ray() -> None:
    """Stop the private Ray this driver started, if any, and wait until its processes are gone; names those
    that outlive the wait (its reaper stops them once this driver exits)."""
    from slime_spec.cluster import private_ray
    left = private_ray.stop()
    if left:
        print(f"[train] {len(left)} process(es) of the private Ray still running {private_ray.STOP_WAIT_S:.0f} s "
              f"after ray.shutdown, left to its reaper: {', '.join(left)}", file=sys.stderr, flush=True)


RESYNC_POLL_S = 1.0
LIVENESS_POLL_S = 5.0  # how often the engines' liveness is checked while a rollout, an eval or a sync runs
SYNC_ATTEMPTS = 3  # a sync that loses an engine runs again, in full, once the engine is restarted


def run_all(steps: list[tuple[str, Callable[[], object]]]) -> list[str]:
    """Run every shutdown step even when an earlier one raises; returns (and prints) what failed."""
    failures = []
    for name, step in steps:
        try:
            step()
        except Exception as e:  # reported, and raised by the caller once every step ran
            failures.append(f"{name}: {type(e).__name__}: {e}")
            print(f"[train] {name} failed: {e}", file=sys.stderr, flush=True)
    return failures


def restarted_engine_urls(manager) -> list[str]:
    """URLs of the engines the fleet fenced after a restart (they must rejoin and get a full sync)."""
    import ray

    needing = ray.get(manager.engines_needing_sync.remote())
    if not needing:
        return []
    urls = ray.get(manager.engine_urls.remote())
    return [urls[i] for i in needing]


def check_engines(manager, generate: bool) -> list[int]:
    """Every engine's liveness now: a dead or hung one is restarted and fenced until the trainer re-syncs it.
    `generate` (a token generated through /generate, as SGLang's /health_generate asks) only where no sync has the
    engines paused."""
    import ray

    return ray.get(manager.check_engines.remote(generate))


def restart_stuck(manager, error: BaseException) -> list[int]:
    """The engines a failed sync left stuck in its broken broadcast (`WeightSyncError.stuck_urls`; Ray's error
    wrapping it reads the attribute through) are restarted: SGLang's /ping answers while their scheduler waits."""
    import ray

    urls = getattr(error, "stuck_urls", None) or []
    if not urls:
        return []
    return ray.get(manager.restart_stuck.remote(urls, "stuck in a broken weight-update broadcast"))


def sync_and_confirm(manager, version: str, restarted_urls: list[str],
                     sync: Callable[[str, list[str]], dict]) -> dict:
    """`sync(version, restarted_urls)`, then every engine must report `version` (which lifts its fence)."""
    import ray

    metrics = sync(version, restarted_urls)
    still = ray.get(manager.confirm_weights.remote(version))
    if still:
        raise RuntimeError(f"engine(s) {still} do not report weight version {version!r} after the sync; "
                           "see the engine logs")
    return metrics


def resync_fenced(manager, resync: Callable[[str, list[str]], dict]) -> dict:
    """Engines the fleet fenced after a restart get the current weights (group rejoined, full sync, canary)
    before they serve again; `resync(version, restarted_urls)` is the trainer's sync."""
    import ray

    restarted = restarted_engine_urls(manager)
    if not restarted:
        return {}
    version = ray.get(manager.weight_version.remote())
    print(f"[train] engine(s) {restarted} restarted: re-syncing weights {version!r} before they serve", flush=True)
    return {f"resync/{k}": v for k, v in sync_engines(manager, version, resync).items()}


def sync_engines(manager, version: str, sync: Callable[[str, list[str]], dict], restarted_before: int = 0) -> dict:
    """`sync(version, restarted_urls)` into every engine, then each must report `version`. The engines' liveness
    is checked meanwhile (/ping: the sync pauses them). An engine lost during the sync (killed, or hung until
    its probe's bound) is restarted, and the sync runs again in full: the others take the same weights again
    and the restarted one rejoins the weight-update group; at most SYNC_ATTEMPTS times. Metrics: the sync's, its
    attempts, and the engines restarted for it (`restarted_before`, found by the check before it, and since)."""
    restarted = restarted_before
    for attempt in range(1, SYNC_ATTEMPTS + 1):
        lost: list[int] = []
        try:
            metrics = sync_and_confirm(manager, version, restarted_engine_urls(manager),
                                       lambda v, urls: watch_engines(manager, lambda: sync(v, urls), lost))
            return {**metrics, "weight_sync_attempts": attempt,
                    "weight_sync_engines_restarted": restarted + len(lost)}
        except Exception as e:
            lost += restart_stuck(manager, e)
            lost += check_engines(manager, generate=False)
            restarted += len(lost)
            if not lost or attempt == SYNC_ATTEMPTS:
                raise
            print(f"[train] the weight sync of {version!r} lost engine(s) {sorted(set(lost))}, restarted since "
                  f"({type(e).__name__}: {str(e)[:300]}); syncing again, attempt {attempt + 1} of {SYNC_ATTEMPTS}",
                  flush=True)
    raise AssertionError("unreachable")


def watch_engines(manager, call: Callable[[], dict], restarted: list[int]) -> dict:
    """`call()` on a thread while the engines' liveness is checked every LIVENESS_POLL_S; the engines restarted
    meanwhile are added to `restarted` (a restart ends a collective that waited on the dead engine)."""
    from concurrent.futures import ThreadPoolExecutor, wait

    pool = ThreadPoolExecutor(max_workers=1)
    try:
        future = pool.submit(call)
        while not wait([future], timeout=LIVENESS_POLL_S).done:
            restarted += check_engines(manager, generate=False)
        return future.result()
    finally:
        pool.shutdown(wait=False)


def serve_fenced(manager, start: Callable[[], object], resync: Callable[[str, list[str]], dict]) -> tuple[object, dict]:
    """A rollout or an eval (`start()` returns its ref). Before it, every engine's liveness (a dead or hung one
    is restarted and re-synced before it serves); meanwhile, /ping every LIVENESS_POLL_S and every engine
    restarted during it re-synced (it is fenced until then)."""
    import ray

    check_engines(manager, generate=True)
    metrics = resync_fenced(manager, resync)
    ref = start()
    next_check = time.monotonic() + LIVENESS_POLL_S
    while True:
        done, _ = ray.wait([ref], timeout=RESYNC_POLL_S)
        if not done and time.monotonic() >= next_check:
            check_engines(manager, generate=False)
            next_check = time.monotonic() + LIVENESS_POLL_S
        metrics.update(resync_fenced(manager, resync))
        if done:
            return ray.get(ref), metrics


def generate_fenced(manager, rollout_id: int, resync: Callable[[str, list[str]], dict]) -> tuple[list, dict]:
    """One rollout, fenced (`serve_fenced`)."""
    return serve_fenced(manager, lambda: manager.generate.remote(rollout_id), resync)


def eval_fenced(manager, rollout_id: int, resync: Callable[[str, list[str]], dict]) -> dict:
    """The eval datasets, fenced (`serve_fenced`); the re-sync's metrics are prefixed `eval_resync/`."""
    out, metrics = serve_fenced(manager, lambda: manager.eval.remote(rollout_id), resync)
    return {**out, **{f"eval_{k}": v for k, v in metrics.items()}}


def sync_all(trainer, manager, version: str, probe_samples=None, engines_generate: bool = True) -> dict:
    """The trainer's weights into every engine as `version`, after every engine's liveness is checked; engines
    restarted since the last sync rejoin (`sync_engines`). `engines_generate=False`: their KV cache is released
    (a colocated step's staged resume), so the liveness check only pings and the canary waits
    (`canary_after` after the resume)."""
    restarted = check_engines(manager, generate=engines_generate)
    probe_samples = probe_samples if engines_generate else None  # the deferred canary has its probe already
    return sync_engines(manager, version, lambda v, urls: trainer.sync_weights(
        v, probe_samples=probe_samples, restarted_urls=urls, defer_canary=not engines_generate),
        restarted_before=len(restarted))


def run(config: Config, *, manager_kwargs: dict | None = None) -> dict:
    """The whole loop; returns the summary that is also printed and written to output_dir."""
    from slime_spec.cluster.placement import place_run, remove_placement
    started_ray = init_ray()
    try:
        placement = place_run(config)  # one placement group for trainer and engines (None without GPUs)
        try:
            return _run_placed(config, placement, manager_kwargs or {})
        finally:
            remove_placement(placement)
    finally:
        if started_ray:  # the driver exits only once every process of its Ray is gone
            stop_private_ray()


def _run_placed(config: Config, placement, manager_kwargs: dict) -> dict:
    import ray

    from slime_spec.rollout.debug_rollout import run_debug_rollout_only
    from slime_spec.rollout.manager import start_rollout_manager
    from slime_spec.trainer.group import TrainGroup
    engines_placement = placement if placement is not None and placement.assignment.engine_bundles else None
    if config.debug_rollout_only:
        return run_debug_rollout_only(config, placement=engines_placement, **manager_kwargs)

    # The driver writes one merged line per step (rollout + train + sync) and owns the wandb run.
    manager = None if config.debug_train_only else start_rollout_manager(
        dataclasses.replace(config, wandb=WandbConfig()), placement=engines_placement, report_metrics=False,
        **manager_kwargs)
    steps = []
    if manager is not None:
        steps.append(("rollout manager shutdown", lambda: ray.get(manager.shutdown.remote())))
        steps.append(("rollout manager kill", lambda: ray.kill(manager)))
    probe = None
    try:
        if manager is not None and config.spec_speedup_interval:  # its engines start with the fleet's and trainer
            probe = spec_speedup.SpeedupProbe(config, engines_placement)
            steps.insert(0, ("speed-up probe shutdown", probe.shutdown))
        trainer = TrainGroup(config, placement=placement)
        steps.insert(0, ("trainer shutdown", trainer.shutdown))
        summary = _loop(config, trainer, manager, probe)
    except BaseException:
        run_all(steps)  # the loop's error is the one raised; shutdown failures are printed
        raise
    failures = run_all(steps)
    if failures:
        raise RuntimeError("the run finished but shutting down failed: " + "; ".join(failures))
    return summary


def _loop(config: Config, trainer, manager, probe=None) -> dict:
    """The steps, with the plain engine of `--spec-speedup-interval` (`probe`, if set) beside the fleet."""
    import ray

    from slime_spec.driver.gpu_memory import GpuMemoryMonitor
    report = LoopReport(config)
    start = trainer.start_rollout_id()
    memory = GpuMemoryMonitor.start_if_available()  # peak memory per GPU, per step
    try:
        if probe is not None:
            probe.connect(ray.get(manager.engine_urls.remote())[0])
        return _steps(config, trainer, manager, report, start, probe, memory)
    finally:
        if memory is not None:
            memory.close()


def _steps(config: Config, trainer, manager, report: LoopReport, start: int, probe, memory=None) -> dict:
    import ray

    from slime_spec.rollout.debug_data import load_rollout
    from slime_spec.trainer.checkpoint import save_due
    def resync(version: str, restarted_urls: list[str]) -> dict:
        return trainer.sync_weights(version, restarted_urls=restarted_urls)

    if manager is not None:
        trainer.connect_engines(ray.get(manager.engine_urls.remote()))
        if start > 0:  # resumed from --load: the engines serve --hf-checkpoint, not the loaded policy
            restore_data_position(config, manager, start)
            sync_all(trainer, manager, str(start - 1))
        if config.eval_interval and start == 0 and not config.skip_eval_before_train:  # as slime: a baseline
            report.set_initial_eval(eval_fenced(manager, 0, resync))
    colocated = config.cluster.colocate and manager is not None
    offloads = colocated and trainer.uses_gpu
    if colocated:  # SGLang's tag names (already imported: the flags were parsed with its ServerArgs)
        from sglang.srt.constants import GPU_MEMORY_TYPE_CUDA_GRAPH, GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS
    if offloads:  # the trainer's GPU memory is the engines' while they generate
        trainer.offload()
    for rollout_id in range(start, config.rollout.num_rollout):
        step = {"rollout_id": rollout_id}
        step_start, measuring_s = time.perf_counter(), 0.0  # the speed-up probe and eval are not the step's work
        if manager is None:
            samples = load_rollout(config.rollout.load_debug_rollout_data, rollout_id)
            step.update(replayed_samples=len(samples))
        else:
            samples, resync_metrics = generate_fenced(manager, rollout_id, resync)
            step.update(ray.get(manager.get_last_metrics.remote()))
            step.update(resync_metrics)
        clock = PhaseClock()
        if colocated:
            trainer.canary_before(samples)  # the reading before the sync, while the engines still generate
            with clock.phase("engine_release_s"):
                ray.get(manager.release_memory.remote())
        if offloads:
            step.update(trainer.onload())
        with clock.phase("train_time_s"):
            step.update(trainer.train_step(samples, rollout_id))
        last = rollout_id + 1 == config.rollout.num_rollout
        if config.train.save and (last or save_due(config.train.save_interval, rollout_id)):
            trainer.save(rollout_id, None if manager is None else ray.get(manager.data_position.remote(rollout_id)))
        if offloads:  # after the save, which reads the weights where they train; the sync reads them from host
            step.update(trainer.offload())
        if colocated:  # slime's staged resume: the weights, the sync into them, then the KV cache and graphs
            with clock.phase("engine_resume_s"):
                ray.get(manager.resume_memory.remote([GPU_MEMORY_TYPE_WEIGHTS]))
        if manager is not None:
            with clock.phase("sync_time_s"), memory.window("sync") if memory is not None else nullcontext():
                step.update(sync_all(trainer, manager, str(rollout_id), probe_samples=samples,
                                     engines_generate=not colocated))
        if colocated:
            with clock.phase("engine_resume_s"):
                ray.get(manager.resume_memory.remote([GPU_MEMORY_TYPE_CUDA_GRAPH, GPU_MEMORY_TYPE_KV_CACHE]))
            step.update(trainer.canary_after())
        step.update(clock.seconds)
        if probe is not None and spec_speedup.due(config.spec_speedup_interval, rollout_id, config.rollout.num_rollout,
                                                  first_rollout=start):
            probe_start = time.perf_counter()
            step.update(probe.measure(samples, trainer.hf_state_dict(), str(rollout_id)))
            measuring_s += time.perf_counter() - probe_start
        step["step_time_s"] = time.perf_counter() - step_start - measuring_s
        if "rollout_time_s" in step:
            step.update(spec_speedup.step_speedup_metrics(step))
        if manager is not None and config.eval_interval and (rollout_id + 1) % config.eval_interval == 0:
            step.update(eval_fenced(manager, rollout_id, resync))
        if memory is not None:
            step.update(memory.take_peaks())
        report.add(step)
    return report.finish()


def restore_data_position(config: Config, manager, start: int) -> None:
    """The prompt stream continues where the loaded checkpoint saved it (checkpoint.DATA_POSITION)."""
    import ray

    from slime_spec.trainer.checkpoint import read_data_position
    saved = read_data_position(config.train.load, start - 1)
    if saved is not None:
        for note in ray.get(manager.restore_data_position.remote(saved, start)):
            print(f"[train] {note}", flush=True)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C (every `finally` runs: engines and Ray stop) instead of killing at once."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()
    exit_on_sigterm()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = preflight(argv)
    except ArgsError as e:
        print(f"slime-spec: {e}", file=sys.stderr)
        return 2
    from slime_spec.driver.run_lock import RunLock, RunLocked, run_directories
    from slime_spec.rollout.manager import RolloutFailed
    from slime_spec.trainer.checkpoint import CheckpointError, plan_resume
    from slime_spec.trainer.finite_guard import NonFiniteError
    try:  # before anything starts: a --load / --save pair that would overwrite saved iterations is refused
        if not config.debug_rollout_only:
            print(f"[train] {plan_resume(config.train.load, config.train.save).message}", flush=True)
    except CheckpointError as e:
        print(f"slime-spec: {e}", file=sys.stderr, flush=True)
        return 2
    lock = RunLock(run_directories(config.output_dir, config.train.save), argv)
    try:  # one run per output directory (and --save)
        lock.acquire()
    except RunLocked as e:
        print(f"slime-spec: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        summary = run(config)
    except (RolloutFailed, NonFiniteError, CheckpointError) as e:  # Ray's error is also one of these
        print(f"slime-spec: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        lock.release()
    print(json.dumps({k: v for k, v in summary.items() if k != "rollouts"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
