"""WeightSyncer against the FakeSGLangServer double: transports, protocols, selectors, failures, checks."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from slime_spec.config.run_config import WeightSyncConfig
from slime_spec.fleet.client import EngineClient, EngineError
from slime_spec.tools.tiny_model import make_config, make_weights
from slime_spec.weight_sync.gather import iter_hf_state
from slime_spec.weight_sync.protocol import SpecSetup
from slime_spec.weight_sync.sync import WeightSyncer, WeightSyncError
from tests.test_weight_sync_fake_server import FakeSGLangServer, fuse_hf_state

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


def make_syncer(servers, transport, spec=NATIVE, check=True, buffer=4096, tmp_path=None, has_mtp=True,
                trains_draft=False):
    clients = [EngineClient(s.url) for s in servers]
    config = WeightSyncConfig(weight_sync_transport=transport, update_weight_buffer_size=buffer,
                              check_weight_sync=check, weight_sync_check_interval=1)  # every sync checked
    return WeightSyncer(clients, config,
                        hf_config=MIMO, hf_checkpoint=tmp_path / "ckpt" if tmp_path else "/nonexistent",
                        spec=spec, has_mtp_layers=has_mtp, transport=transport,
                        disk_dir=tmp_path / "sync" if tmp_path else None, timeout_s=60, trains_draft=trains_draft)


def assert_serves(server: FakeSGLangServer, state: dict[str, torch.Tensor], runner="target"):
    weights = getattr(server, runner).weights
    expected = fuse_hf_state(state)
    for name, t in weights.items():
        assert torch.equal(t, expected[name]), f"{runner}:{name} is not the synced tensor"


@pytest.fixture
def ckpt(tmp_path):
    from slime_spec.tools.tiny_model import make_tiny_model
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
            continue
        updates = [b for p, b in s.calls if p.startswith("/update_weights_from")]
        assert {b.get("selector") for b in updates} == {"all"} and len(updates) > 1
        # the last update labels and flushes, as /update_weight_version and /flush_cache would; no earlier one does
        closing = [(b["weight_version"], b["flush_cache"], b.get("torch_empty_cache")) for b in updates]
        assert closing == [(None, False, False)] * (len(updates) - 1) + [("1", True, True)]
        assert "/flush_cache" not in paths and "/update_weight_version" not in paths
        last_update = max(i for i, p in enumerate(paths) if p.startswith("/update_weights_from"))
        assert paths.index("/begin_weight_update") < last_update < paths.index("/end_weight_update")


class GatedUpdates:
    """A syncer into one FakeSGLangServer that receives and loads each update at once but answers it only once
    `gate` is set (or after 10 s, then with an error, so a sync that waits for the reply before gathering on fails
    instead of hanging). `log` records each request, and when each update was received and answered; `in_flight()`
    says (waiting up to 10 s for the server) that an update has been posted and reached the server."""

    def __init__(self, make_server, transport: str, seed: int):
        self.server = make_server(draft="mtp")
        self.new = make_weights(MIMO, seed=seed)
        self.tensors = list(iter_hf_state(self.new, MIMO))
        self.syncer = make_syncer([self.server], transport, buffer=sum(t.nbytes for t in self.tensors) // 3)
        self.syncer.prepare()
        self.gate, self.log, self._posted = threading.Event(), [], threading.Event()
        handle, post = self.server.handle, self.syncer.transport.post

        def gated(method, path, body):
            if not path.startswith("/update_weights_from"):
                self.log.append(path)
                return handle(method, path, body)
            self.log.append(f"{path} received")
            out = handle(method, path, body)
            if not self.gate.wait(10):
                out = 500, {"detail": "the next bucket was never gathered"}
            self.log.append(f"{path} answered")
            return out

        def noting(*args, **kwargs):
            in_flight = post(*args, **kwargs)
            self._posted.set()
            return in_flight

        self.server.handle, self.syncer.transport.post = gated, noting

    def in_flight(self) -> bool:
        deadline = time.monotonic() + 10
        while self._posted.is_set() and not any(p.endswith("received") for p in self.log):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return self._posted.is_set()


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_the_next_bucket_is_gathered_while_one_is_in_flight(make_server, transport):
    """Each update is answered only after the sync has pulled the next bucket's tensors: a sync that waits for a
    bucket's reply before gathering the next would never get it."""
    g = GatedUpdates(make_server, transport, seed=1)

    def stream():
        for t in g.tensors:
            if g.in_flight():
                g.gate.set()  # an update is in flight and the sync asks for more: the next bucket is being gathered
            yield t
        g.gate.set()  # the last bucket has nothing after it to gather

    g.syncer.sync(stream(), weight_version="1")
    g.syncer.close()
    assert_serves(g.server, g.new, "target") and assert_serves(g.server, g.new, "draft")


def test_a_failure_while_a_bucket_is_in_flight_lets_it_land_before_undoing(make_server):
    """The tensor stream fails while a bucket is posted and not answered: the syncer waits for that bucket's reply
    before it rolls back, so the session is closed after the last update, never under it."""
    g = GatedUpdates(make_server, "tensor", seed=1)

    def failing():
        for t in g.tensors:
            if g.in_flight():
                threading.Timer(0.5, g.gate.set).start()  # answered only after the stream has failed
                raise RuntimeError("injected: the gather failed")
            yield t

    with pytest.raises(WeightSyncError, match="injected: the gather failed") as err:
        g.syncer.sync(failing(), weight_version="2")
    assert g.log.index("/update_weights_from_tensor answered") < g.log.index("/end_weight_update")
    assert "1 applied bucket" in str(err.value) and err.value.engines_serve_previous_weights is False


def test_old_sglang_is_spoken_without_session_or_selector(make_server):
    server = make_server(draft="mtp", session_routes=False)
    new = make_weights(MIMO, seed=2)
    syncer = make_syncer([server], "tensor")
    syncer.sync(iter_hf_state(new, MIMO), weight_version="1")
    assert not syncer.protocol.session
    assert "/begin_weight_update" not in server.paths() and server.contract_errors == []
    # without a session the label and the flush stay separate requests, after every update
    paths = server.paths()
    last_update = max(i for i, p in enumerate(paths) if p.startswith("/update_weights_from"))
    assert last_update < paths.index("/flush_cache") < paths.index("/update_weight_version")
    assert all(b["weight_version"] is None for p, b in server.calls if p.startswith("/update_weights_from"))
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


# ---- a failed sync claims only what it verified (issue 11, item 2) ----

def _injecting(tensors, at: int, inject):
    """The tensors, with `inject()` run when the sync asks for tensor `at` (the buckets before it have been posted;
    the last of them may still be in flight)."""
    for i, t in enumerate(tensors):
        if i == at:
            inject()
        yield t


@pytest.fixture(scope="module")
def new_checkpoint(tmp_path_factory):
    """A checkpoint of the session MiMo engine's shapes, another seed."""
    from slime_spec.tools.tiny_model import make_tiny_model
    from tests.helpers.engine_server import TINY

    return make_tiny_model(tmp_path_factory.mktemp("syncer_new") / "new", arch="mimo", seed=1, **TINY)


@pytest.fixture
def embedded(tiny_mimo_engine, new_checkpoint):
    """(served, new, engine): the session's MiMo engine (EAGLE over its MTP layer, tests/conftest.py) back on its
    checkpoint `served`, version "default", generating; `new` has the same shapes."""
    tiny_mimo_engine.reset()
    return tiny_mimo_engine.model_path, new_checkpoint, tiny_mimo_engine


def _embedded_syncer(clients, served):
    from tests.helpers.engine_server import checkpoint_config as _config

    config = WeightSyncConfig(update_weight_buffer_size=4096, weight_sync_check_interval=1)  # every sync checked
    return WeightSyncer(clients, config, hf_config=_config(served),
                        hf_checkpoint=served, spec=SpecSetup("EAGLE", None, str(served)), has_mtp_layers=True,
                        transport="tensor")


def _new_state(path):
    from tests.helpers.engine_server import checkpoint_config as _config
    from tests.helpers.engine_server import checkpoint_state as _state

    return list(iter_hf_state(_state(path), _config(path)))


def _checksums(engine):
    return engine.client.post("/weights_checker", {"action": "checksum", "selector": "all"})["ranks"]


def test_engine_restarted_mid_sync_is_reported_serving_the_checkpoint_not_rolled_back(embedded):
    """The engine comes back mid-sync with its checkpoint and no session: its rollback reply says
    `rolled_back: false`, and the syncer must read back that it serves the checkpoint, not the previous weights."""
    served, new, engine = embedded
    syncer = _embedded_syncer([engine.client], served)
    syncer.sync(iter(_new_state(new)), weight_version="1")

    def restart():  # what a restarted engine serves: the checkpoint, version "default", no session
        engine.client.post("/end_weight_update", {})
        engine.client.post("/update_weights_from_disk", {"model_path": str(served), "weight_version": "default"})

    with pytest.raises(WeightSyncError, match="CHECKPOINT") as err:
        syncer.sync(_injecting(_new_state(served), 10, restart), weight_version="2")
    verdict, = err.value.engines
    assert (verdict.serves, verdict.weight_version) == ("checkpoint", "default")
    assert verdict.agree < verdict.total
    assert not err.value.engines_serve_previous_weights and engine.paused
    assert "0 of 1 engine(s) rolled the session back" in str(err.value) and "PAUSED" in str(err.value)
    metrics = err.value.metrics()
    assert metrics["weight_sync_engine0_serves"] == "checkpoint" and metrics["weight_sync_resumed_on_previous"] == 0


def test_stray_end_weight_update_mid_sync_is_reported_as_a_mix(embedded):
    """Someone closes the session half way: the buckets that landed stay (no rollback is possible), so the
    engine serves a mix, still under the previous version label (the new label is set only once a whole sync has
    ended); the syncer says so with the checksum counts."""
    served, new, engine = embedded
    syncer = _embedded_syncer([engine.client], served)
    state = _new_state(new)
    with pytest.raises(WeightSyncError, match="MIX") as err:
        syncer.sync(_injecting(state, len(state) // 3, lambda: engine.client.post("/end_weight_update", {})),
                    weight_version="2")
    verdict, = err.value.engines
    assert verdict.serves == "mix" and verdict.weight_version == "default"
    assert 0 < verdict.agree < verdict.total  # some tensors still equal the checkpoint, some are new
    assert f"{verdict.agree}/{verdict.total} checksums" in str(err.value)
    assert not err.value.engines_serve_previous_weights
    assert engine.paused  # generation stays paused: a mix must not serve rollouts
    syncer.sync(iter(state), weight_version="3")  # a full sync repairs it
    assert engine.generate([5, 6, 7])["meta_info"]["weight_version"] == "3"


def test_engine_killed_mid_sync_survivor_is_verified_and_continues(embedded):
    """Two engines; the second dies (connections refused) after the first buckets landed. The survivor rolls
    its session back and is verified on the previous weights by checksum, so generation continues on it (the
    dead engine serves nothing, and a restarted one is re-synced before it serves); the message names the dead one."""
    from tests.helpers.engine_server import checkpoint_config as _config
    from tests.helpers.engine_server import checkpoint_state as _state

    served, new, engine = embedded
    victim = FakeSGLangServer(_state(served), _config(served), draft="mtp")
    before, sums_before = engine.generate([5, 6, 7, 8, 9]), _checksums(engine)
    syncer = _embedded_syncer([engine.client, EngineClient(victim.url)], served)
    real_handle, updates = victim.handle, []

    def dying_handle(method, path, body):
        if path == "/update_weights_from_tensor":
            updates.append(path)
            if len(updates) == 3:  # SIGKILL: the listening socket goes, the request gets no answer
                victim.close()
                raise ConnectionAbortedError("killed")
        return real_handle(method, path, body)

    victim.handle = dying_handle
    with pytest.raises(WeightSyncError) as err:
        syncer.sync(iter(_new_state(new)), weight_version="2")
    alive, dead = err.value.engines
    assert (alive.serves, alive.weight_version, alive.agree) == ("previous", "default", alive.total)
    assert dead.serves == "unreachable" and f"{victim.url}: UNREACHABLE" in str(err.value)
    assert err.value.engines_serve_previous_weights
    assert "generation continues on every engine that answers" in str(err.value)
    assert _checksums(engine) == sums_before
    assert not engine.paused
    assert engine.generate([5, 6, 7, 8, 9])["output_ids"] == before["output_ids"]  # the previous weights


def test_sglang_without_rollback_reports_what_each_engine_holds(make_server):
    """SGLang has no /abort_weight_update (404): the session is closed with /end_weight_update and each engine is
    read back; the engine that loaded a bucket is a mix, the one that refused the first still serves the previous."""
    new = make_weights(MIMO, seed=11)
    good, bad = make_server(draft="mtp"), make_server(draft="mtp", fail_on_name="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(WeightSyncError, match="PAUSED") as err:
        make_syncer([good, bad], "tensor", buffer=2048).sync(iter_hf_state(new, MIMO), weight_version="4")
    by_url = {v.url: v for v in err.value.engines}
    # the label changes only after a whole sync ends: a failed one leaves the previous label
    assert by_url[good.url].serves == "mix" and by_url[good.url].weight_version == good.weight_version != "4"
    assert by_url[bad.url].serves == "mix"  # it loaded the buckets before the one it refused
    assert 0 < by_url[bad.url].agree < by_url[bad.url].total
    assert good.session is None and bad.session is None and good.paused and bad.paused
    assert "/abort_weight_update" in good.paths() and "/end_weight_update" in good.paths()


def test_check_interval_skips_the_coverage_check_and_a_later_failure_says_unverified(make_server):
    server = make_server(draft="mtp")
    syncer = make_syncer([server], "tensor", check=False)
    syncer.config = WeightSyncConfig(weight_sync_transport="tensor", update_weight_buffer_size=4096,
                                     weight_sync_check_interval=2)
    checks = lambda: server.paths().count("/weights_checker")  # noqa: E731
    first = syncer.sync(iter_hf_state(make_weights(MIMO, seed=1), MIMO), weight_version="1")
    assert first["weight_sync_checked"] == 0 and checks() == 1  # the baseline read only, no coverage check
    second = syncer.sync(iter_hf_state(make_weights(MIMO, seed=2), MIMO), weight_version="2")
    assert second["weight_sync_checked"] == 1 and checks() == 2
    for key in ("weight_sync_s", "weight_sync_gbps", "rollout_paused_s", "weight_sync_gather_convert_s",
                "weight_sync_control_s", "weight_sync_send_s", "weight_sync_flush_s", "weight_sync_check_s"):
        assert second[key] >= 0, key
    assert second["rollout_paused_s"] == second["weight_sync_s"]
    syncer.sync(iter_hf_state(make_weights(MIMO, seed=3), MIMO), weight_version="3")  # unchecked
    server.fail_on_name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(WeightSyncError, match="UNVERIFIED.*weight-sync-check-interval") as err:
        syncer.sync(iter_hf_state(make_weights(MIMO, seed=4), MIMO), weight_version="4")
    assert err.value.engines[0].serves == "unverified" and server.paused


EAGLE3 = SpecSetup("EAGLE3", "/eagle3", "/ckpt")


def eagle3_state(seed: int) -> dict[str, torch.Tensor]:
    """An EAGLE3 draft's own tensors (checkpoint names) for MIMO's shapes: one of them, lm_head.weight, is
    also a target name, with a different (draft-vocabulary) shape."""
    from slime_spec.common.eagle3_draft import Eagle3Draft
    config = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
              "vocab_size": 48, "draft_vocab_size": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
    torch.manual_seed(seed)
    draft = Eagle3Draft(config, num_aux=3)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_()
    return {n: p.detach().clone() for n, p in draft.named_parameters()}


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_trained_eagle3_draft_is_synced_with_selector_draft_and_never_touches_the_target(make_server, transport):
    from slime_spec.weight_sync.gather import iter_draft_tensors
    server = make_server(draft="external", draft_state=eagle3_state(0))
    shared = server.target.weights["model.embed_tokens.weight"]
    server.draft.weights["model.embed_tokens.weight"] = shared  # SGLang shares the target's embedding
    syncer = make_syncer([server], transport, spec=EAGLE3, trains_draft=True)
    for step in range(2):
        new, draft = make_weights(MIMO, seed=20 + step), eagle3_state(30 + step)
        metrics = syncer.sync(itertools.chain(iter_hf_state(new, MIMO), iter_draft_tensors(draft.items())),
                              weight_version=str(step))
        target_only = {n: t for n, t in new.items() if not n.startswith("model.mtp_layers.")}
        assert_serves(server, target_only, "target")  # lm_head.weight too: the draft's never reached it
        assert_serves(server, {**draft, "model.embed_tokens.weight": new["model.embed_tokens.weight"]}, "draft")
        assert metrics["weight_sync_draft_params"] == len(draft) and metrics["weight_sync_mtp_params"] == 0
    syncer.close()
    assert server.contract_errors == []
    begins = [b["selector"] for p, b in server.calls if p == "/begin_weight_update"]
    assert begins == ["all", "all"]
    updates = [(b["selector"], b.get("names")) for p, b in server.calls if p.startswith("/update_weights_from")]
    assert {s for s, _ in updates} == {"target", "draft"}
    if transport == "distributed":  # every draft name went with selector draft, no target name did
        draft_names = {n for s, names in updates if s == "draft" for n in names}
        assert draft_names == set(eagle3_state(0))
        assert not any(n.startswith(("fc.", "midlayer.")) for s, names in updates if s == "target" for n in names)


def test_trained_draft_changed_outside_the_sync_is_still_caught(make_server):
    """Tensors of the trained draft that the sync does not send must stay as loaded (the frozen check)."""
    from slime_spec.weight_sync.gather import iter_draft_tensors
    server = make_server(draft="external", draft_state=eagle3_state(0))
    syncer = make_syncer([server], "tensor", spec=EAGLE3, trains_draft=True, check=False)
    draft = {n: t for n, t in eagle3_state(1).items() if n != "norm.weight"}
    syncer.sync(itertools.chain(iter_hf_state(make_weights(MIMO, seed=3), MIMO), iter_draft_tensors(draft.items())))
    server.draft.weights["norm.weight"].add_(1.0)
    with pytest.raises(WeightSyncError, match=r"draft\.model\.norm\.weight"):  # SGLang's name for it
        syncer.sync(itertools.chain(iter_hf_state(make_weights(MIMO, seed=4), MIMO),
                                    iter_draft_tensors(draft.items())))


def test_draft_tensors_to_a_frozen_draft_are_refused(make_server):
    from slime_spec.weight_sync.gather import iter_draft_tensors
    server = make_server(draft="external", draft_state=eagle3_state(0))
    before = {n: t.clone() for n, t in server.draft.weights.items()}
    syncer = make_syncer([server], "tensor", spec=EAGLE3)
    with pytest.raises(WeightSyncError, match="trains_draft"):
        syncer.sync(itertools.chain(iter_hf_state(make_weights(MIMO, seed=3), MIMO),
                                    iter_draft_tensors(eagle3_state(1).items())))
    assert all(torch.equal(before[n], t) for n, t in server.draft.weights.items())


# ---- a failure undoes first (other trainer ranks, engine sessions), then reports what it read back ----

class OneRankBuckets:
    """colocated.RankBuckets of a group with rank 0 alone: its own state machine, its messages recorded
    (`on_message`) instead of broadcast, so the syncer's per-rank path runs without other processes."""

    def __new__(cls, on_message):
        from slime_spec.weight_sync.transports.colocated import ENDED, ColocatedLayout, RankBuckets
        class Channel(RankBuckets):
            def __init__(self):
                self.group, self.layout, self.rank, self.state, self.wait_s = None, ColocatedLayout(1, 1), 0, ENDED, 0.0

            def _broadcast(self, message):
                on_message(message)
                return message

            def _gather(self, entry):
                return [entry]

        return Channel()


def failing_at(tensors, at: int):
    for i, t in enumerate(tensors):
        if i == at:
            raise RuntimeError("rank 0's conversion failed (injected)")
        yield t


def test_a_failure_ends_the_sync_on_the_other_trainer_ranks_before_the_engines_are_rolled_back(make_server):
    """The other colocated trainer ranks wait in the bucket exchange: they are told the sync is over before the
    engines' sessions are closed and read back (which take an HTTP round trip per engine and a checksum of
    every served tensor), not after."""
    server = make_server(draft="mtp")
    messages, paths_at_abort = [], []

    def on_message(message):
        messages.append(message[0] if isinstance(message, tuple) else message)
        if isinstance(message, tuple) and message[0] == "abort":
            paths_at_abort.extend(server.paths())

    channel = OneRankBuckets(on_message)
    clients = [EngineClient(server.url)]
    config = WeightSyncConfig(weight_sync_transport="tensor", update_weight_buffer_size=2048,
                              weight_sync_check_interval=1)
    syncer = WeightSyncer(clients, config, hf_config=MIMO, hf_checkpoint="/nonexistent", spec=NATIVE,
                          has_mtp_layers=True, transport="tensor", rank_buckets=channel)
    with pytest.raises(WeightSyncError, match="injected") as err:
        syncer.sync(failing_at(iter_hf_state(make_weights(MIMO, seed=5), MIMO), 6), weight_version="5")
    assert messages[0] == "start" and messages[-1] == "abort" and messages.count("abort") == 1
    assert "/update_weights_from_tensor" in paths_at_abort  # a bucket landed before the failure
    assert "/abort_weight_update" not in paths_at_abort and "/end_weight_update" not in paths_at_abort
    assert paths_at_abort.count("/weights_checker") == 1  # the baseline only, not yet the read-back
    assert server.paths()[-3:] == ["/abort_weight_update", "/end_weight_update", "/weights_checker"]
    assert not err.value.engines_serve_previous_weights and server.session is None


def test_per_rank_bucket_wait_is_reported_in_the_split(make_server):
    """colocated.RankBuckets.wait_s (rank 0 waiting for the other ranks' entries) is the sync's
    weight_sync_ranks_wait_s, inside send_s, and left out of the HTTP share."""
    server = make_server(draft="mtp")
    channel = OneRankBuckets(lambda message: None)
    config = WeightSyncConfig(weight_sync_transport="tensor", update_weight_buffer_size=2048,
                              weight_sync_check_interval=1)
    syncer = WeightSyncer([EngineClient(server.url)], config, hf_config=MIMO, hf_checkpoint="/nonexistent",
                          spec=NATIVE, has_mtp_layers=True, transport="tensor", rank_buckets=channel)
    new = make_weights(MIMO, seed=7)
    report = syncer.sync_report(iter_hf_state(new, MIMO), weight_version="7")
    assert_serves(server, new, "target")
    assert report.split.ranks_wait_s == channel.wait_s <= report.split.send_s
    assert report.metrics()["weight_sync_ranks_wait_s"] == channel.wait_s
    split = report.split
    assert split.http_s == max(0.0, split.send_s - split.engine_receive_s - split.engine_load_s - channel.wait_s)
    plain = make_syncer([make_server(draft="mtp")], "tensor").sync(iter_hf_state(new, MIMO))
    assert plain["weight_sync_ranks_wait_s"] == 0.0


class EndFailsOnce(EngineClient):
    """A client whose next `/end_weight_update` (once armed) fails without reaching the engine: a lost reply."""

    armed = False

    def post(self, path, payload=None, read_timeout_s=None):
        if path == "/end_weight_update" and self.armed:
            self.armed = False
            raise EngineError(self.url, path, 503, "injected: end_weight_update lost")
        return super().post(path, payload, read_timeout_s)


def test_a_failed_end_weight_update_is_rolled_back_and_verified_on_the_previous_weights(embedded):
    """Every bucket landed, then /end_weight_update failed: the session is still open on the engine, so it is
    rolled back (not left open with the new weights loaded, refusing the next begin), read back on the previous
    weights, and generation continues; the next sync lands."""
    served, new, engine = embedded
    client = EndFailsOnce(engine.url)
    syncer = _embedded_syncer([client], served)
    syncer.sync(iter(_new_state(new)), weight_version="1")
    sums_after_first = _checksums(engine)
    client.armed = True
    with pytest.raises(WeightSyncError, match="injected: end_weight_update lost") as err:
        syncer.sync(iter(_new_state(served)), weight_version="2")
    verdict, = err.value.engines
    assert (verdict.serves, verdict.weight_version) == ("previous", "1")
    assert err.value.engines_serve_previous_weights and not engine.paused
    assert "1 of 1 engine(s) rolled the session back" in str(err.value)
    assert _checksums(engine) == sums_after_first
    syncer.sync(iter(_new_state(served)), weight_version="3")  # the session was closed: begin is accepted
    assert engine.generate([5, 6, 7])["meta_info"]["weight_version"] == "3"


def test_an_engine_that_took_begin_is_closed_when_another_refused_it(make_server):
    """/begin_weight_update lands on one engine and fails on the other: the one that took it has an open session,
    which the failure closes (else its next begin is refused); neither loaded anything, so both serve the
    previous weights and generation continues."""
    good, bad = make_server(draft="mtp"), make_server(draft="mtp")
    real_handle = bad.handle
    bad.handle = lambda m, p, b: ((500, {"detail": "injected"}) if p == "/begin_weight_update"
                                  else real_handle(m, p, b))
    syncer = make_syncer([good, bad], "tensor")
    with pytest.raises(WeightSyncError, match="previous weights") as err:
        syncer.sync(iter_hf_state(make_weights(MIMO, seed=3), MIMO), weight_version="3")
    assert err.value.engines_serve_previous_weights
    assert good.session is None and not good.paused and not bad.paused
    bad.handle = real_handle
    new = make_weights(MIMO, seed=4)
    syncer.sync(iter_hf_state(new, MIMO), weight_version="4")
    assert_serves(good, new) and assert_serves(bad, new)


def test_a_read_back_that_fails_after_a_failure_claims_nothing(make_server):
    """The sync fails, then reading the engine back fails too: the sync's own error is raised (not the
    read-back's), the engine is `unverified`, naming why, and generation stays paused."""
    server = make_server(draft="mtp", fail_on_name="model.layers.1.mlp.up_proj.weight")
    real_handle, checks = server.handle, []

    def handle(method, path, body):
        if path == "/weights_checker":
            checks.append(path)
            if len(checks) > 1:  # the baseline read succeeds, the read-back after the failure does not
                return 500, {"detail": "injected: checksum kernel failed"}
        return real_handle(method, path, body)

    server.handle = handle
    with pytest.raises(WeightSyncError, match="injected failure while loading") as err:
        make_syncer([server], "tensor", buffer=2048).sync(iter_hf_state(make_weights(MIMO, seed=2), MIMO))
    verdict, = err.value.engines
    assert verdict.serves == "unverified" and "reading back what it serves failed" in verdict.reason
    assert "checksum kernel failed" in str(err.value) and "PAUSED" in str(err.value)
    assert not err.value.engines_serve_previous_weights and server.paused and server.session is None
