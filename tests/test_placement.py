"""placement.py's pure bundle sorting and assignment; the sglang-router argv the rollout manager launches."""

import pytest

from slime_spec.cluster.gpu_check import layout
from slime_spec.cluster.placement import assign, node_key, sorted_bundles
from slime_spec.rollout.router import ROUTER_HEALTH_INTERVAL_S, sglang_router_argv


def test_layout_colocate_shares_bundles_separate_adds_them():
    assert layout(8, 8, colocate=True) == (8, 0)
    assert layout(4, 8, colocate=True) == (8, 0)
    assert layout(4, 8, colocate=False) == (12, 4)
    assert layout(0, 2, colocate=False) == (2, 0)


def test_node_key_orders_ips_numerically_then_names():
    assert node_key("10.0.0.9") < node_key("10.0.0.10") < node_key("node-a")


def test_bundles_sorted_by_node_then_gpu():
    locations = [("10.0.0.2", 1), ("10.0.0.10", 0), ("10.0.0.2", 0), ("10.0.0.10", 1)]
    assert sorted_bundles(locations) == [2, 0, 1, 3]


def test_colocated_rank_and_engine_share_each_gpu():
    locations = [("10.0.0.1", 1), ("10.0.0.1", 0)]  # Ray returned them out of order
    a = assign(locations, actor_gpus=2, rollout_gpus=2, gpus_per_engine=1, colocate=True)
    assert a.actor_bundles == (1, 0)
    assert a.engine_bundles == ((1,), (0,)) and a.engine_gpus == ((0,), (1,))


def test_separate_placement_actor_first_then_engines():
    locations = [("10.0.0.1", g) for g in (3, 2, 1, 0)]
    a = assign(locations, actor_gpus=2, rollout_gpus=2, gpus_per_engine=1, colocate=False)
    assert [locations[b][1] for b in a.actor_bundles] == [0, 1]
    assert a.engine_gpus == ((2,), (3,))


def test_two_nodes_tp4_engine_stays_on_one_node():
    # Ray interleaves the bundles of two 4-GPU nodes; each TP-4 engine must get one node's four GPUs.
    locations = [("10.0.0.2", 3), ("10.0.0.1", 0), ("10.0.0.2", 0), ("10.0.0.1", 3),
                 ("10.0.0.2", 1), ("10.0.0.1", 1), ("10.0.0.2", 2), ("10.0.0.1", 2)]
    a = assign(locations, actor_gpus=8, rollout_gpus=8, gpus_per_engine=4, colocate=True)
    assert a.engine_nodes == ("10.0.0.1", "10.0.0.2")
    assert a.engine_gpus == ((0, 1, 2, 3), (0, 1, 2, 3))
    for bundles, node in zip(a.engine_bundles, a.engine_nodes):
        assert {locations[b][0] for b in bundles} == {node}
    assert [locations[b] for b in a.actor_bundles] == sorted(locations, key=lambda x: (node_key(x[0]), x[1]))


def test_engine_that_would_span_nodes_is_an_error_naming_the_flags():
    # 2 actor GPUs on node 1 leave 2 + 4 rollout GPUs: a TP-4 engine cannot be cut from node 1's two.
    locations = [("10.0.0.1", g) for g in range(4)] + [("10.0.0.2", g) for g in range(2)]
    with pytest.raises(ValueError, match="span nodes.*--rollout-num-gpus-per-engine"):
        assign(locations, actor_gpus=2, rollout_gpus=4, gpus_per_engine=4, colocate=False)


def test_rollout_gpus_not_a_multiple_of_engine_size():
    with pytest.raises(ValueError, match="--rollout-num-gpus=3 is not a multiple"):
        assign([("n", 0), ("n", 1), ("n", 2)], actor_gpus=0, rollout_gpus=3, gpus_per_engine=2, colocate=False)


def test_sglang_router_argv_health_check_outlasts_a_sync():
    argv = sglang_router_argv("python", 4000, ["http://a:1", "http://b:2"], engine_start_timeout_s=1800)
    assert argv[:8] == ["python", "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "4000",
                        "--worker-urls"]
    flags = dict(zip(argv[10::2], argv[11::2]))
    assert argv[8:10] == ["http://a:1", "http://b:2"]
    assert flags["--health-check-endpoint"] == "/health"
    interval, failures = int(flags["--health-check-interval-secs"]), int(flags["--health-failure-threshold"])
    assert interval == ROUTER_HEALTH_INTERVAL_S
    assert (failures - 1) * interval >= 24 * 3600  # marked dead only after a day of failed checks
    assert flags["--health-success-threshold"] == "1"
    longer = sglang_router_argv("python", 4000, ["http://a:1"], engine_start_timeout_s=48 * 3600)
    assert (int(dict(zip(longer[9::2], longer[10::2]))["--health-failure-threshold"]) - 1) * interval >= 48 * 3600


def test_sglang_router_parses_the_argv():
    """Checked against the real router's own parser where sglang-router is installed."""
    launch_router = pytest.importorskip("sglang_router.launch_router")
    args = launch_router.parse_router_args(sglang_router_argv("python", 4000, ["http://a:1"], 1800)[3:])
    assert args.worker_urls == ["http://a:1"] and args.health_check_endpoint == "/health"
    assert args.health_failure_threshold > 1000 and args.health_check_interval_secs == ROUTER_HEALTH_INTERVAL_S


def test_placement_timeout_flag_reaches_the_run_and_doctor_bounds_it(mimo7b):
    from slime_spec.cluster.placement import PLACEMENT_TIMEOUT_S
    from slime_spec.config.args import parse
    from slime_spec.doctor.diagnose import diagnose
    def check(*extra):
        config, findings = diagnose(parse(["--hf-checkpoint", str(mimo7b), "--rollout-backend", "embedded", *extra]))
        return config, [f for f in findings if f.level == "error"]

    config, errors = check()
    assert config.cluster.placement_timeout == PLACEMENT_TIMEOUT_S == 300.0 and not errors  # default unchanged
    config, errors = check("--placement-timeout", "0")  # no bound, as slime waits
    assert config.cluster.placement_timeout == 0.0 and not errors
    _, errors = check("--placement-timeout", "-1")
    assert [(f.code, f.fix) for f in errors] == [("FLAG_OUT_OF_RANGE", "--placement-timeout 300")]


def test_beside_engine_binds_the_engines_gpus_explicitly():
    """The speed-up engines ask Ray for no GPU (Ray 2.60 then leaves CUDA_VISIBLE_DEVICES as the node has it), so
    they go into engine 0's bundle and get its GPU ids to bind; on CPU, neither."""
    from slime_spec.cluster.placement import Assignment, Placement, beside_engine

    assert beside_engine(None) == ({}, None)
    a = assign([("10.0.0.1", g) for g in (1, 0)], actor_gpus=1, rollout_gpus=1, gpus_per_engine=1, colocate=False)
    group = object()  # the placement group: only carried into the scheduling strategy
    options, gpu_ids = beside_engine(Placement(group, a))
    assert gpu_ids == [1] == list(a.engine_gpus[0])
    strategy = options["scheduling_strategy"]
    assert strategy.placement_group is group and strategy.placement_group_bundle_index == a.engine_bundles[0][0] == 0
    assert beside_engine(Placement(group, Assignment((0,), (), (), ()))) == ({}, None)  # a run with no engines


def test_on_gpus_the_placement_counts_the_engines_for_the_embedded_backend_too():
    """--rollout-num-engines counts engines where there are no GPUs: the GPU demo's slime-style flags (two rollout
    GPUs, one per engine, the embedded backend, no --rollout-num-engines) start two engines."""
    from slime_spec.cluster.placement import Placement, engines_to_start
    from slime_spec.config.args import parse_config

    config, _ = parse_config(["--hf-checkpoint", "/m", "--rollout-backend", "embedded", "--actor-num-gpus-per-node",
                              "2", "--rollout-num-gpus", "2", "--colocate"])
    assert config.num_engines == 1  # the flag's default: what a machine without GPUs starts
    a = assign([("10.0.0.1", g) for g in (0, 1)], actor_gpus=2, rollout_gpus=2, gpus_per_engine=1, colocate=True)
    assert engines_to_start(config, Placement(object(), a)) == 2
    assert engines_to_start(config, None) == 1


def test_the_engines_started_get_their_share_of_the_rollout_as_request_cap(monkeypatch):
    """The per-engine request cap (a plain embedded engine's --max-running-requests) is the rollout's samples over
    the engines actually started: two on the placement's two GPUs, not the one --rollout-num-engines defaults to."""
    from slime_spec.cluster.placement import Placement
    from slime_spec.config.args import parse_config
    from slime_spec.rollout import manager

    config, _ = parse_config(["--hf-checkpoint", "/m", "--rollout-backend", "embedded", "--actor-num-gpus-per-node",
                              "2", "--rollout-num-gpus", "2", "--colocate", "--rollout-batch-size", "8",
                              "--n-samples-per-prompt", "8"])
    assert config.engine.in_flight_per_engine == 64  # the flags' one engine takes the whole rollout
    started = {}

    class Actor:
        @staticmethod
        def options(**_):
            return Actor

        @staticmethod
        def remote(rollout, engine, engines, **_):
            started.update(engine=engine, engines=engines)

    monkeypatch.setattr(manager, "RolloutManagerActor", Actor)
    a = assign([("10.0.0.1", g) for g in (0, 1)], actor_gpus=2, rollout_gpus=2, gpus_per_engine=1, colocate=True)
    manager.start_rollout_manager(config, Placement(object(), a))
    assert started["engines"] == 2 and started["engine"].in_flight_per_engine == 32
    assert started["engine"].embedded_running_argv() == ["--max-running-requests", "32"]


def test_engine_server_process_binds_its_gpus():
    from slime_spec.config.run_config import EngineConfig
    from slime_spec.fleet.process import engine_server_process

    engine = EngineConfig(backend="embedded", model_path="/m")
    assert engine_server_process(engine, log_path="/tmp/x.log", gpu_ids=[1]).env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert engine_server_process(engine, log_path="/tmp/x.log").env is None
