"""WeightSyncer against the FakeSGLangServer double: transports, protocols, selectors, failures, checks."""

from __future__ import annotations


import pytest
import torch

from slime_spec.config import WeightSyncConfig
from slime_spec.tiny_model import make_config, make_weights
from slime_spec.engines.client import EngineClient
from slime_spec.weight_sync.gather import iter_hf_state
from slime_spec.weight_sync.protocol import SpecSetup
from slime_spec.weight_sync.sync import WeightSyncer, WeightSyncError
from tests.test_weight_sync_fake_server import FakeSGLangServer, fuse_hf_state
from slime_spec.net import free_port

MIMO = make_config("mimo", vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=64, max_position_embeddings=128, dtype="float32", mtp_layers=1,
                   tie_word_embeddings=False)
NATIVE = SpecSetup("EAGLE", None, "/ckpt")
STANDALONE = SpecSetup("STANDALONE", "/draft", "/ckpt")




@pytest.fixture
def make_server():
    made = []

    def make(**kwargs) -> FakeSGLangServer:
        made.append(FakeSGLangServer(make_weights(MIMO, seed=0), MIMO, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def make_syncer(servers, transport, spec=NATIVE, check=True, buffer=4096, tmp_path=None, has_mtp=True):
    clients = [EngineClient(s.url) for s in servers]
    config = WeightSyncConfig(weight_sync_transport=transport, update_weight_buffer_size=buffer,
                              check_weight_sync=check)
    return WeightSyncer(clients, config,
                        hf_config=MIMO, hf_checkpoint=tmp_path / "ckpt" if tmp_path else "/nonexistent",
                        spec=spec, has_mtp_layers=has_mtp, transport=transport,
                        master_port=free_port() if transport == "distributed" else None,
                        disk_dir=tmp_path / "sync" if tmp_path else None, timeout_s=60)


def assert_serves(server: FakeSGLangServer, state: dict[str, torch.Tensor], runner="target"):
    weights = getattr(server, runner).weights
    expected = fuse_hf_state(state)
    for name, t in weights.items():
        assert torch.equal(t, expected[name]), f"{runner}:{name} is not the synced tensor"


@pytest.fixture
def ckpt(tmp_path):
    from slime_spec.tiny_model import make_tiny_model

    make_tiny_model(tmp_path / "ckpt", arch="mimo", vocab_size=48, hidden_size=32, num_layers=2,
                    intermediate_size=64, max_position_embeddings=128)
    return tmp_path


@pytest.mark.parametrize("transport", ["distributed", "tensor", "disk"])
def test_native_mtp_sync_reaches_target_and_draft(make_server, transport, ckpt):
    servers = [make_server(draft="mtp"), make_server(draft="mtp")]
    new = make_weights(MIMO, seed=1)
    syncer = make_syncer(servers, transport, tmp_path=ckpt)
    metrics = syncer.sync(iter_hf_state(new, MIMO), weight_version="1")
    syncer.close()
    n_mtp = sum(n.startswith("model.mtp_layers.") for n in new)
    assert metrics["weight_sync_params"] == len(new) - n_mtp and metrics["weight_sync_mtp_params"] == n_mtp
    assert metrics["weight_sync_s"] > 0 and metrics["weight_sync_gbps"] > 0
    for s in servers:
        assert s.contract_errors == []
        assert_serves(s, new, "target")
        assert_serves(s, new, "draft")
        paths = [p for p in s.paths() if p != "/destroy_weights_update_group"]  # close() destroys the group
        assert paths[0] == "/pause_generation" and paths[-1] == "/continue_generation" and not s.paused
        if transport == "disk":
            assert "/begin_weight_update" not in paths  # disk needs no session and has no selector
        else:
            assert paths.index("/begin_weight_update") < paths.index("/end_weight_update") < paths.index("/flush_cache")
            selectors = {b.get("selector") for p, b in s.calls if p.startswith("/update_weights_from")}
            assert selectors == {"all"}


def test_old_sglang_is_spoken_without_session_or_selector(make_server):
    server = make_server(draft="mtp", session_routes=False)
    new = make_weights(MIMO, seed=2)
    syncer = make_syncer([server], "tensor")
    syncer.sync(iter_hf_state(new, MIMO), weight_version="1")
    assert not syncer.protocol.session
    assert "/begin_weight_update" not in server.paths() and server.contract_errors == []
    assert_serves(server, new, "target")
    assert_serves(server, new, "draft")


def test_old_sglang_distributed_with_mtp_draft_is_refused(make_server):
    server = make_server(draft="mtp", session_routes=False)
    with pytest.raises(ValueError, match="27718"):
        make_syncer([server], "distributed").sync(iter_hf_state(make_weights(MIMO, seed=2), MIMO))


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_standalone_draft_keeps_its_own_weights_through_syncs(make_server, transport):
    draft_state = make_weights(MIMO, seed=7)  # same names and shapes as the target: the slime#1177 trap
    draft_state = {n: t for n, t in draft_state.items() if not n.startswith("model.mtp_layers.")}
    server = make_server(draft="external", draft_state=draft_state)
    syncer = make_syncer([server], transport, spec=STANDALONE)
    for step in range(2):
        new = make_weights(MIMO, seed=10 + step)
        syncer.sync(iter_hf_state(new, MIMO), weight_version=str(step))
        target_only = {n: t for n, t in new.items() if not n.startswith("model.mtp_layers.")}
        assert_serves(server, target_only, "target")
        assert_serves(server, draft_state, "draft")
    syncer.close()
    assert {b.get("selector") for p, b in server.calls if p.startswith("/update_weights_from")} == {"target"}
    assert not any(n.startswith("model.mtp_layers.") for p, b in server.calls for n in b.get("names", []))


def test_overwritten_external_draft_is_detected(make_server):
    draft_state = {n: t for n, t in make_weights(MIMO, seed=7).items() if not n.startswith("model.mtp_layers.")}
    server = make_server(draft="external", draft_state=draft_state)
    syncer = make_syncer([server], "tensor", spec=STANDALONE, check=False)
    syncer.sync(iter_hf_state(make_weights(MIMO, seed=3), MIMO))
    server.draft.weights["model.norm.weight"].add_(1.0)  # what a sync with selector "all" would do to the draft
    with pytest.raises(WeightSyncError, match="external draft.*1177"):
        syncer.sync(iter_hf_state(make_weights(MIMO, seed=4), MIMO))


def test_failure_in_first_request_keeps_previous_weights_and_generation(make_server):
    server = make_server(draft="mtp", fail_on_name="model.embed_tokens.weight")
    before = {n: t.clone() for n, t in server.target.weights.items()}
    syncer = make_syncer([server], "tensor", buffer=1 << 30)  # one target bucket: all or nothing
    with pytest.raises(WeightSyncError, match="previous weights") as err:
        syncer.sync(iter_hf_state(make_weights(MIMO, seed=5), MIMO), weight_version="5")
    assert err.value.engines_serve_previous_weights
    assert all(torch.equal(before[n], t) for n, t in server.target.weights.items())
    assert not server.paused and server.session is None


def test_failure_half_way_is_reported_and_a_resync_recovers(make_server):
    new = make_weights(MIMO, seed=6)
    last_target = [n for n in new if not n.startswith("model.mtp_layers.")][-1]
    server = make_server(draft="mtp", fail_on_name=last_target)
    syncer = make_syncer([server], "distributed", buffer=2048)
    with pytest.raises(WeightSyncError, match="PAUSED") as err:
        syncer.sync(iter_hf_state(new, MIMO), weight_version="6")
    assert not err.value.engines_serve_previous_weights
    assert server.paused and server.session is None  # session closed, generation held back from the mix
    server.fail_on_name = None
    syncer.sync(iter_hf_state(new, MIMO), weight_version="6")
    assert_serves(server, new, "target")
    assert not server.paused
    syncer.close()


def test_check_weight_sync_detects_a_mismatch(make_server, monkeypatch):
    server = make_server(draft="mtp")
    syncer = make_syncer([server], "tensor")
    real_apply = type(server.draft).apply

    def corrupting_apply(runner, writes):  # an engine that loads the MTP projection wrongly
        real_apply(runner, writes)
        if runner is server.draft:
            runner.weights["model.mtp_layers.0.input_proj.weight"].mul_(-1)

    monkeypatch.setattr(type(server.draft), "apply", corrupting_apply)
    with pytest.raises(WeightSyncError, match="input_proj"):
        syncer.sync(iter_hf_state(make_weights(MIMO, seed=8), MIMO))


def test_unwritten_served_weight_is_detected(make_server):
    server = make_server(draft="mtp")
    new = {n: t for n, t in make_weights(MIMO, seed=9).items() if n != "model.mtp_layers.0.final_layernorm.weight"}
    with pytest.raises(WeightSyncError, match="final_layernorm"):
        make_syncer([server], "tensor", check=False).sync(iter_hf_state(new, MIMO))


def test_first_request_failing_on_one_engine_of_two_is_a_mix(make_server):
    new = make_weights(MIMO, seed=11)
    good, bad = make_server(draft="mtp"), make_server(draft="mtp", fail_on_name="model.embed_tokens.weight")
    with pytest.raises(WeightSyncError, match="PAUSED") as err:
        make_syncer([good, bad], "tensor", buffer=1 << 30).sync(iter_hf_state(new, MIMO))
    assert not err.value.engines_serve_previous_weights  # the good engine loaded the first bucket
    assert good.paused and bad.paused and bad.url in str(err.value)


def test_eagle3_draft_sharing_the_target_embedding_passes_the_frozen_draft_check(make_server):
    """SGLang gives an EAGLE3 draft the target's embedding: it follows every sync, its own layers must not."""
    draft_state = {n: t for n, t in make_weights(MIMO, seed=7).items() if not n.startswith("model.mtp_layers.")}
    server = make_server(draft="external", draft_state=draft_state)
    server.draft.weights["model.embed_tokens.weight"] = server.target.weights["model.embed_tokens.weight"]
    syncer = make_syncer([server], "tensor", spec=SpecSetup("EAGLE3", "/eagle3", "/ckpt"), check=False)
    new = make_weights(MIMO, seed=3)
    syncer.sync(iter_hf_state(new, MIMO))
    assert torch.equal(server.draft.weights["model.embed_tokens.weight"], new["model.embed_tokens.weight"])
    server.draft.weights["model.norm.weight"].add_(1.0)  # one of the draft's own tensors changes: still caught
    with pytest.raises(WeightSyncError, match="draft.model.norm.weight"):
        syncer.sync(iter_hf_state(make_weights(MIMO, seed=4), MIMO))


def test_gpu_engine_values_are_compared_by_name(make_server, monkeypatch):
    """On device cuda the CPU checksum is not SGLang's: the check reads values back by name instead."""
    server = make_server(draft="mtp")
    syncer = make_syncer([server], "tensor")
    syncer.prepare()
    syncer.engine_device = "cuda"  # as SGLang on GPU reports it; the fake serves the same routes
    syncer.sync(iter_hf_state(make_weights(MIMO, seed=5), MIMO))
    assert [c.methods for c in syncer.last_value_checks] == [["get_weights_by_name"]]
    real_apply = type(server.target).apply

    def corrupting_apply(runner, writes):
        real_apply(runner, writes)
        if runner is server.target:
            runner.weights["model.layers.1.mlp.down_proj.weight"].add_(0.5)

    monkeypatch.setattr(type(server.target), "apply", corrupting_apply)
    with pytest.raises(WeightSyncError, match=r"get_weights_by_name.*down_proj.*max \|engine - sent\|"):
        syncer.sync(iter_hf_state(make_weights(MIMO, seed=6), MIMO))


def test_gpu_engine_without_get_weights_by_name_says_values_cannot_be_compared(make_server, monkeypatch):
    server = make_server(draft="mtp")
    real_handle = server.handle
    monkeypatch.setattr(server, "handle", lambda m, p, b: (400, {"success": False, "message": "not for MiMo"})
                        if p == "/get_weights_by_name" else real_handle(m, p, b))
    syncer = make_syncer([server], "tensor")
    syncer.prepare()
    syncer.engine_device = "cuda"
    with pytest.raises(WeightSyncError, match="values cannot be compared.*Triton"):
        syncer.sync(iter_hf_state(make_weights(MIMO, seed=5), MIMO))
