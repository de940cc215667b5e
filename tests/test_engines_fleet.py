"""fleet/fleet.py: least-loaded routing, and a restarted engine fenced until it serves the current weights.

The restart test runs the real pieces: two embedded engines under a RolloutManager on Ray, the trainer's
side as a WeightSyncer over the distributed transport (gloo) in this process, and the driver's own
`generate_fenced` / `run_all` from slime_spec/driver/loop.py.
"""

import asyncio
import json
import os
import signal
import textwrap

import pytest
import ray
from safetensors.torch import load_file

from slime_spec.config.run_config import EngineConfig, RolloutConfig, WeightSyncConfig
from slime_spec.driver.loop import generate_fenced, run_all
from slime_spec.fleet.client import EngineClient, EngineGroupError
from slime_spec.fleet.fleet import NoEngineAvailable, Router, pick_engine
from slime_spec.rollout.manager import RolloutManagerActor
from slime_spec.rollout.sample import Sample, Status, exclude_stale
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.weight_sync.gather import iter_hf_state
from slime_spec.weight_sync.protocol import SpecSetup
from slime_spec.weight_sync.sync import WeightSyncer

TINY = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64,
            max_position_embeddings=256)


def test_pick_engine():
    assert pick_engine([3, 1, 1], [True, True, True], 4) == 1
    assert pick_engine([3, 1, 0], [True, True, False], 4) == 1
    assert pick_engine([4, 4], [True, True], 4) is None
    assert pick_engine([1, 2], [True, True], 4, requests=3) == 0  # a group's requests fit under the cap
    assert pick_engine([2, 3], [True, True], 4, requests=3) is None
    assert pick_engine([0, 1], [True, True], 4, requests=8) == 0  # an idle engine takes a group past the cap


def test_a_waiting_group_does_not_hold_back_a_single_request():
    async def main():
        r = Router(1, max_concurrency=4)
        assert await r.acquire(4) == 0
        group = asyncio.create_task(r.acquire(2))  # both wait, the group first
        await asyncio.sleep(0.01)
        single = asyncio.create_task(r.acquire())
        await asyncio.sleep(0.01)
        await r.release(0)  # room for one: the single request, though the group waited longer
        await asyncio.sleep(0.01)
        assert single.done() and not group.done() and r.in_flight == [4]
        await r.release(0, 3)  # room for the group
        assert await group == 0 and r.in_flight == [3]
    asyncio.run(main())


def test_router_waits_for_capacity_and_fails_when_all_dead():
    async def main():
        r = Router(2, max_concurrency=1)
        a, b = await r.acquire(), await r.acquire()
        assert {a, b} == {0, 1}
        waiter = asyncio.create_task(r.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await r.release(b)
        assert await waiter == b
        await r.set_available(0, False, dead=True)
        await r.set_available(1, False, dead=True)
        with pytest.raises(NoEngineAvailable, match="slime-spec doctor"):
            await r.acquire()
    asyncio.run(main())


def test_fenced_engine_is_waited_for_not_used():
    async def main():
        r = Router(2, max_concurrency=4)
        await r.set_available(0, False)  # fenced: restarted, not yet synced
        assert [await r.acquire() for _ in range(3)] == [1, 1, 1]
        await r.set_available(1, False, dead=True)
        waiter = asyncio.create_task(r.acquire())  # engine 0 will be synced: wait, do not fail
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await r.set_available(0, True)
        assert await waiter == 0
    asyncio.run(main())


def test_samples_of_other_weights_are_excluded_and_counted():
    samples = [Sample(index=i, group_index=0, prompt="p", weight_version=v, engine_index=i)
               for i, v in enumerate(["3", "default", "3"])]
    samples[2].status = Status.ABORTED
    assert exclude_stale(samples, "3") == 1
    assert samples[0].status == Status.COMPLETED
    assert samples[1].status == Status.ABORTED and "'default'" in samples[1].error and "excluded" in samples[1].error


def _state(path):
    return load_file(str(path / "model.safetensors"))


def _checksums(url):
    reply = EngineClient(url).post("/weights_checker", {"action": "checksum", "selector": "all"})
    return reply["ranks"][0]["checksums"]


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    model = make_tiny_model(root / "served", arch="llama", seed=0, **TINY)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"input": f"{i}+{i}="}) + "\n" for i in range(4)))
    # Arms a SIGKILL of an engine server while the rollout's first requests are in flight.
    (root / "fleet_kill_hook.py").write_text(textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from slime_spec.rollout.generate import default_generate
        PID_FILE = Path({str(root / "kill_pid")!r})
        async def generate_killing_engine(client, sample, sampling_params):
            if sample.index == 2 and PID_FILE.exists():
                pid = int(PID_FILE.read_text())
                PID_FILE.unlink()
                os.kill(pid, signal.SIGKILL)
            return await default_generate(client, sample, sampling_params)
    """))
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(root)}})
    rollout = RolloutConfig(hf_checkpoint=str(model), prompt_data=str(root / "prompts.jsonl"), rollout_batch_size=4,
                            n_samples_per_prompt=2, rollout_max_response_len=6, sglang_server_concurrency=2,
                            custom_generate_function_path="fleet_kill_hook.generate_killing_engine")
    manager = RolloutManagerActor.options(num_cpus=0).remote(
        rollout, EngineConfig(backend="embedded", model_path=str(model)), 2, log_dir=str(root / "logs"),
        show_progress=False)
    urls = ray.get(manager.engine_urls.remote())
    syncer = WeightSyncer([EngineClient(u) for u in urls], WeightSyncConfig(check_weight_sync=True),
                          hf_config=json.loads((model / "config.json").read_text()), hf_checkpoint=model,
                          spec=SpecSetup(None, None, str(model)), has_mtp_layers=False, transport="distributed",
                          timeout_s=60)  # a regression hangs 60 s, not 5 min
    try:
        yield root, manager, urls, syncer
    finally:
        try:
            syncer.close()
        except EngineGroupError:
            pass  # the last test leaves a restarted engine without a group on purpose
        ray.get(manager.shutdown.remote())
        ray.shutdown()


def _weights(root, seed):
    path = make_tiny_model(root / f"policy{seed}", arch="llama", seed=seed, **TINY)
    return _state(path), json.loads((path / "config.json").read_text())


def test_restarted_engine_rejoins_gets_current_weights_and_next_sync_works(run):
    root, manager, urls, syncer = run
    state1, config = _weights(root, 1)
    syncer.sync(iter_hf_state(state1, config), weight_version="1")
    assert ray.get(manager.confirm_weights.remote("1")) == []
    served = _checksums(urls[1])

    engines = ray.get(manager.engines.remote())
    old_pid = ray.get(engines[0].pid.remote())
    (root / "kill_pid").write_text(str(old_pid))
    resyncs = []

    def resync(version, restarted_urls):  # what TrainGroup.sync_weights does on the trainer's rank 0
        resyncs.append((version, list(restarted_urls)))
        syncer.rejoin(restarted_urls)
        return syncer.sync(iter_hf_state(state1, config), weight_version=version)

    samples, metrics = generate_fenced(manager, 0, resync)
    rollout = ray.get(manager.get_last_metrics.remote())
    assert not (root / "kill_pid").exists() and not _pid_alive(old_pid)
    assert rollout["engine_restarts"] == 1 and resyncs == [("1", [urls[0]])]
    assert metrics["resync/weight_sync_params"] > 0
    # every sample says which weights made it, and all are the policy's current ones
    assert all(s.weight_version == "1" for s in samples), [(s.engine_index, s.weight_version) for s in samples]
    assert rollout["stale_samples"] == 0 and all(s.status != Status.ABORTED for s in samples)
    # the restarted engine serves the current weights, not --hf-checkpoint's
    assert _checksums(urls[0]) == served
    assert EngineClient(urls[0]).get("/model_info")["weight_version"] == "1"

    # the next sync forms the group again with every engine and does not hang
    state2, _ = _weights(root, 2)
    syncer.sync(iter_hf_state(state2, config), weight_version="2")
    assert ray.get(manager.confirm_weights.remote("2")) == []
    assert _checksums(urls[0]) == _checksums(urls[1]) != served
    after, _ = generate_fenced(manager, 1, resync)
    assert {s.weight_version for s in after} == {"2"} and len(resyncs) == 1


def test_shutdown_stops_the_engines_when_the_trainer_side_fails(run):
    root, manager, urls, syncer = run
    engines = ray.get(manager.engines.remote())
    pids = [ray.get(e.pid.remote()) for e in engines]
    os.kill(pids[0], signal.SIGKILL)
    assert ray.get(engines[0].ensure_alive.remote())  # restarted: it left the weight-update group
    pids[0] = ray.get(engines[0].pid.remote())
    failures = run_all([("trainer shutdown", syncer.close),
                        ("rollout manager shutdown", lambda: ray.get(manager.shutdown.remote()))])
    assert len(failures) == 1 and "destroy_weights_update_group" in failures[0]
    assert syncer.transport.group is None  # this side left the group even so
    assert not any(_pid_alive(p) for p in pids)


class _RecordingActor:
    """Stands in for an engine actor handle (a Ray actor cannot run without a cluster): counts restarts;
    its shutdown is held until `stopped` is set, so a request can fail while the fleet is shutting down."""

    def __init__(self):
        self.restarts = 0
        self.stopped = asyncio.Event()
        self.ensure_alive = self._Remote(self._ensure_alive)
        self.shutdown = self._Remote(self.stopped.wait)

    class _Remote:
        def __init__(self, fn):
            self.fn = fn

        async def remote(self, *args):
            out = self.fn(*args)
            return await out if asyncio.iscoroutine(out) else out

    def _ensure_alive(self, generate=False, stuck=None):  # Engine.ensure_alive's signature
        self.restarts += 1
        return True


def test_a_request_failing_during_shutdown_restarts_nothing(monkeypatch):
    """The SIGINT race: shutdown is stopping the engines, a request in flight fails and calls `recover`;
    the fleet must not ask the engine to come back, and routes nothing more to it."""
    from slime_spec.fleet.fleet import EngineFleet
    fleet = EngineFleet.__new__(EngineFleet)  # no Ray: the routing and restart state only
    actor = _RecordingActor()
    fleet.actors, fleet.num_engines, fleet.generation = [actor], 1, [0]
    fleet.router, fleet.stopping, fleet._locks, fleet._own_placement = Router(1, 2), False, None, None
    monkeypatch.setattr(ray, "kill", lambda a: None)

    async def main():
        stopping = asyncio.create_task(fleet.shutdown())
        await asyncio.sleep(0.01)  # shutdown is waiting for the engine to stop
        await fleet.recover(0, generation=0)  # a request that failed because the server is going away
        actor.stopped.set()
        await stopping
        assert actor.restarts == 0 and fleet.router.dead == [True]
        with pytest.raises(NoEngineAvailable):
            await fleet.router.acquire()
    asyncio.run(main())


def test_engine_command_lines_go_to_a_file_and_one_short_line(tmp_path):
    from slime_spec.fleet.fleet import COMMANDS_FILE, ready_line, write_commands
    engine = EngineConfig(backend="embedded", model_path="/models/m",
                          forwarded_argv=("--speculative-algorithm", "NGRAM"),
                          server_args={"speculative_algorithm": "NGRAM"})
    commands = [engine.server_argv("127.0.0.1", port, engine_index=i) for i, port in enumerate((30001, 30002))]
    path = write_commands(tmp_path / "logs", commands)
    assert path == tmp_path / "logs" / COMMANDS_FILE
    assert path.read_text().splitlines() == [f"engine {i}: {' '.join(c)}" for i, c in enumerate(commands)]
    line = ready_line(engine, ["http://127.0.0.1:30001", "http://127.0.0.1:30002"], "default", path)
    assert line == (f"[fleet] 2 engine(s) ready (embedded, NGRAM, tp 1) on 127.0.0.1 ports 30001, 30002, "
                    f"weights 'default'; command lines: {path}")
    assert "--model-path" not in line and len(line) < 200 + len(str(path))


class _ProbedActor(_RecordingActor):
    """An engine actor double whose liveness check finds it dead or hung once (`problem`), then restarts it."""

    def __init__(self, problem=None):
        super().__init__()
        self.problem, self.checks = problem, []
        self.ensure_alive = self._Remote(self._probe)
        self.weight_version = self._Remote(lambda: "default")
        self.get_url = self._Remote(lambda: "http://127.0.0.1:1")

    def _probe(self, generate=False, stuck=None):  # Engine.ensure_alive's signature and rule: `stuck` restarts
        self.checks.append(generate)
        problem, self.problem = stuck or self.problem, None
        return problem


def _fleet(actors, current="3"):
    from slime_spec.fleet.fleet import EngineFleet
    fleet = EngineFleet.__new__(EngineFleet)  # no Ray: the routing, restart and fence state only
    n = len(actors)
    fleet.actors, fleet.num_engines, fleet.generation, fleet.total_restarts = actors, n, [0] * n, 0
    fleet.router, fleet.stopping, fleet._locks, fleet._own_placement = Router(n, 2), False, None, None
    fleet.urls, fleet.served, fleet.current_version, fleet.needs_sync = ["u"] * n, [current] * n, current, set()
    return fleet


def test_liveness_check_restarts_a_dead_or_hung_engine_and_fences_it():
    """At a phase boundary every engine is probed; the hung one is restarted, serves the checkpoint, and is fenced
    (routed around) until the trainer re-syncs it; the live one is left alone."""
    hung, live = _ProbedActor("/health_generate did not answer within 14 s (hung)"), _ProbedActor()
    fleet = _fleet([live, hung])

    async def main():
        assert await fleet.check_engines(generate=True) == [1]
        assert hung.checks == [True] and live.checks == [True]
        assert fleet.engines_needing_sync() == [1] and fleet.router.available == [True, False]
        assert fleet.served == ["3", "default"] and fleet.generation == [0, 1] and fleet.total_restarts == 1
        assert await fleet.check_engines() == []  # alive now, still fenced: nothing more to do until the sync
        assert fleet.router.available == [True, False] and fleet.engines_needing_sync() == [1]
    asyncio.run(main())


def test_a_dead_engine_that_cannot_restart_is_routed_around():
    class _Gone(_ProbedActor):
        def _probe(self, generate=False, stuck=None):
            raise ray.exceptions.RayActorError()

    fleet = _fleet([_ProbedActor(), _Gone()])

    async def main():
        assert await fleet.check_engines() == []
        assert fleet.router.dead == [False, True] and fleet.live() == [0]
    asyncio.run(main())


def test_an_engine_found_stuck_is_restarted_though_its_probe_answers():
    """A sync names an engine stuck in its broken broadcast (SGLang's /ping answers while the scheduler waits):
    the fleet restarts that one, whatever its probe says, and fences it until the trainer re-syncs it."""
    stuck, live = _ProbedActor(), _ProbedActor()
    fleet = _fleet([live, stuck])
    fleet.urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]

    async def main():
        assert await fleet.restart_stuck(["http://127.0.0.1:2"], "stuck in a broken weight-update broadcast") == [1]
        assert live.checks == [] and stuck.checks == [False]
        assert fleet.engines_needing_sync() == [1] and fleet.router.available == [True, False]
        assert fleet.generation == [0, 1] and fleet.total_restarts == 1
    asyncio.run(main())
