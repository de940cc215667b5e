"""fleet/actor.py: the engine actor's control routes send SGLang's own payloads."""

from slime_spec.config.run_config import EngineConfig
from slime_spec.fleet.actor import Engine
from slime_spec.fleet.sglang_contract import validate_payload

ROUTE_STRUCTS = {
    "/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq", "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput", "/end_weight_update": "EndWeightUpdateReqInput",
    "/generate": "GenerateReqInput",
}


def _recording_engine():
    engine = Engine.__new__(Engine)  # no server: record what each helper would POST
    calls = []
    engine.post = lambda path, payload=None: calls.append((path, payload)) or {}
    return engine, calls


def test_control_payloads_match_sglang_io_structs():
    engine, calls = _recording_engine()
    engine.pause_generation()
    engine.continue_generation()
    engine.abort_request()
    engine.abort_request("rid-1")
    engine.release_memory_occupation(["kv_cache"])
    engine.resume_memory_occupation()
    engine.begin_weight_update("draft")
    engine.end_weight_update()
    assert [p for p, _ in calls] == ["/pause_generation", "/continue_generation", "/abort_request", "/abort_request",
                                     "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
                                     "/begin_weight_update", "/end_weight_update"]
    for path, payload in calls:
        if path != "/flush_cache":  # no body
            validate_payload(ROUTE_STRUCTS[path], payload or {})
    assert calls[2][1] == {"abort_all": True} and calls[7][1] == {"selector": "draft"}


def test_each_engine_gets_its_own_seed():
    """GRPO groups spread over engines must not draw the same random numbers: engine i gets seed + i."""
    cfg = EngineConfig(backend="embedded", model_path="/m", seed=1234)
    seeds = [cfg.server_argv("127.0.0.1", 1, engine_index=i) for i in range(3)]
    assert [a[a.index("--random-seed") + 1] for a in seeds] == ["1234", "1235", "1236"]


def test_a_shut_down_engine_is_never_restarted(tmp_path):
    """Ctrl-C mid-rollout: shutdown stops the server, then a request that failed on it asks `ensure_alive`;
    the engine must stay down (before the fix it restarted a server that outlived the run)."""
    import pytest

    from slime_spec.tools.tiny_model import make_tiny_model
    model = make_tiny_model(tmp_path / "m", arch="llama", hidden_size=32, num_layers=1, intermediate_size=64,
                            max_position_embeddings=128, seed=0)
    engine = Engine(EngineConfig(backend="embedded", model_path=str(model)), 0, log_dir=str(tmp_path / "logs"),
                    start_timeout_s=120)
    try:
        assert engine.alive()
        engine.shutdown()
        assert not engine.alive()
        assert engine.ensure_alive() is None and not engine.alive()
        with pytest.raises(RuntimeError, match="shut down"):
            engine.restart()
        assert not engine.alive()
    finally:
        engine.process.stop()


def test_memory_is_released_only_once_the_engine_is_idle(monkeypatch):
    """SGLang flushes only an idle engine (400 while requests run) and asserts idleness in release: retried, bounded."""
    import pytest

    from slime_spec.fleet import actor
    from slime_spec.fleet.client import EngineError
    monkeypatch.setattr(actor, "FLUSH_RETRY_S", 0.0)
    engine, calls = _recording_engine()
    busy = iter([400, 400])

    def post(path, payload=None):
        calls.append(path)
        if path == "/flush_cache" and next(busy, None):
            raise EngineError("u", path, 400, "Cache not flushed: there are running or waiting requests")
        return {}
    engine.post = post
    engine.release_memory_occupation(["kv_cache"])
    assert calls == ["/flush_cache"] * 3 + ["/release_memory_occupation"]

    calls.clear()
    engine.post = lambda path, payload=None: calls.append(path) or (_ for _ in ()).throw(
        EngineError("u", path, 400, "not idle"))
    with pytest.raises(EngineError, match="not idle after 60 tries"):
        engine.release_memory_occupation()
    assert calls == ["/flush_cache"] * actor.FLUSH_ATTEMPTS  # never released while busy


def test_each_engine_gets_its_own_nccl_port_unless_the_flags_give_one():
    from slime_spec.common.net import free_ports
    from slime_spec.fleet.actor import with_nccl_port
    ports = free_ports(4)
    assert len(set(ports)) == 4 and all(22000 <= p < 30000 for p in ports)  # SGLang's range for it
    argv = ["python", "-m", "sglang.launch_server", "--port", "30000"]
    assert with_nccl_port(argv, ports[0])[-2:] == ["--nccl-port", str(ports[0])]
    given = [*argv, "--nccl-port", "23456"]
    assert with_nccl_port(given, ports[0]) == given and with_nccl_port(argv, None) == argv
