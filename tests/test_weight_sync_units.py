"""Pure parts of the weight sync: buckets, selector policy, protocol detection, payloads, verification, canary."""

from __future__ import annotations

import hashlib

import pytest
import torch

from slime_spec.fleet.sglang_contract import validate_payload
from slime_spec.weight_sync import protocol
from slime_spec.weight_sync.gather import NamedTensor, hf_mtp_matcher, make_buckets
from slime_spec.weight_sync.protocol import SpecSetup, plan_selectors
from slime_spec.weight_sync.verify import canary
from slime_spec.weight_sync.verify import coverage as verify


def _t(name: str, numel: int, kind: str = "target") -> NamedTensor:
    return NamedTensor(name, torch.zeros(numel), kind)  # float32: 4 bytes per element


# ---- buckets ----

def test_buckets_respect_size_and_keep_order():
    tensors = [_t(f"w{i}", 10) for i in range(5)]  # 40 bytes each
    buckets = list(make_buckets(tensors, buffer_bytes=100))
    assert [b.names for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert all(b.nbytes <= 100 for b in buckets)
    assert [b.last for b in buckets] == [False, False, True]  # the final one closes the sync


def test_only_the_final_bucket_is_last_whatever_its_kind():
    tensors = [_t("a", 4), _t("d1", 4, "draft"), _t("m1", 4, "mtp"), _t("b", 40)]
    buckets = list(make_buckets(tensors, buffer_bytes=10))
    assert [(b.kind, b.names, b.last) for b in buckets] == [
        ("target", ["a"], False), ("target", ["b"], False), ("draft", ["d1"], False), ("mtp", ["m1"], True)]


def test_tensor_larger_than_buffer_gets_its_own_bucket():
    buckets = list(make_buckets([_t("small", 5), _t("huge", 100), _t("small2", 5)], buffer_bytes=64))
    assert [b.names for b in buckets] == [["small"], ["huge"], ["small2"]]


def test_target_and_mtp_tensors_never_share_a_bucket():
    tensors = [_t("a", 4), _t("m1", 4, "mtp"), _t("b", 4), _t("m2", 4, "mtp"), _t("c", 4)]
    buckets = list(make_buckets(tensors, buffer_bytes=1000))
    assert [(b.kind, b.names) for b in buckets] == [("target", ["a", "b", "c"]), ("mtp", ["m1", "m2"])]
    assert sum(len(b.tensors) for b in buckets) == len(tensors)


def test_draft_tensors_get_buckets_of_their_own_and_none_is_dropped():
    tensors = [_t("a", 4), _t("d1", 4, "draft"), _t("m1", 4, "mtp"), _t("d2", 4, "draft")]
    buckets = list(make_buckets(tensors, buffer_bytes=1000))
    assert [(b.kind, b.names) for b in buckets] == [("target", ["a"]), ("draft", ["d1", "d2"]), ("mtp", ["m1"])]


def _mla_layer(i: int, kind="target") -> list[NamedTensor]:
    """One DeepSeek-V3 attention block, in the order the converter yields it (q_a_proj first, kv_a later)."""
    p = f"model.layers.{i}.self_attn."
    names = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
             "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    return [NamedTensor(p + n, torch.zeros(10, dtype=torch.uint8), kind) for n in names]


def test_deepseek_fused_a_proj_pair_shares_a_bucket_at_any_size():
    tensors = _mla_layer(0) + _mla_layer(1) + _mla_layer(61, "mtp")
    for buffer in (10, 20, 30, 45, 1000):
        buckets = list(make_buckets(tensors, buffer_bytes=buffer))
        assert sorted(n for b in buckets for n in b.names) == sorted(t.name for t in tensors)
        for layer in (0, 1, 61):
            q, kv = (f"model.layers.{layer}.self_attn.{h}.weight" for h in ("q_a_proj", "kv_a_proj_with_mqa"))
            [holding] = [b for b in buckets if q in b.names]
            assert kv in holding.names, f"buffer {buffer}: layer {layer}'s q_a/kv_a halves were split"
        assert all(b.nbytes <= max(buffer, 20) for b in buckets)  # a pair may exceed the buffer, nothing else


def test_a_half_without_partner_is_sent_when_its_layer_ends():
    layer0 = [t for t in _mla_layer(0) if "q_a_proj" not in t.name]  # q_lora_rank None: no q_a_proj
    buckets = list(make_buckets(layer0 + _mla_layer(1), buffer_bytes=10))
    names = [n for b in buckets for n in b.names]
    assert names.index("model.layers.0.self_attn.kv_a_proj_with_mqa.weight") < names.index(
        "model.layers.1.self_attn.q_a_proj.weight")
    assert len(names) == len(layer0) + 7


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="update_weight_buffer_size"):
        list(make_buckets([_t("a", 1)], 0))


def test_hf_mtp_names_of_both_layouts():
    is_mtp = hf_mtp_matcher({"num_hidden_layers": 2})
    assert is_mtp("model.mtp_layers.0.input_proj.weight")
    assert is_mtp("model.layers.2.eh_proj.weight")  # DeepSeek-V3 / GLM-4.5: layer N is the MTP layer
    assert not is_mtp("model.layers.1.mlp.up_proj.weight")
    assert not is_mtp("lm_head.weight")


# ---- selector policy ----

NATIVE = SpecSetup("EAGLE", None, "/ckpt")
NEXTN_SELF = SpecSetup("NEXTN", "/ckpt", "/ckpt")
EAGLE3 = SpecSetup("EAGLE3", "/eagle3-draft", "/ckpt")
STANDALONE = SpecSetup("STANDALONE", "/small-draft", "/ckpt")
EAGLE_EXTERNAL = SpecSetup("EAGLE", "/eagle-draft", "/ckpt")


@pytest.mark.parametrize("spec", [NATIVE, NEXTN_SELF])
@pytest.mark.parametrize("transport", ["distributed", "tensor", "disk"])
def test_native_mtp_sends_everything_to_all_runners(spec, transport):
    plan = plan_selectors(spec, has_mtp_layers=True, transport=transport, session=True)
    assert (plan.target, plan.mtp) == ("all", "all")
    assert protocol.session_selector(plan) == "all"


@pytest.mark.parametrize("spec", [EAGLE3, STANDALONE, EAGLE_EXTERNAL])
@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_external_draft_never_receives_target_tensors(spec, transport):
    plan = plan_selectors(spec, has_mtp_layers=True, transport=transport, session=True)
    assert (plan.target, plan.mtp) == ("target", None)
    assert protocol.session_selector(plan) == "target"


@pytest.mark.parametrize("algorithm", [None, "NGRAM", "ngram"])
def test_no_draft_runner_means_target_only(algorithm):
    plan = plan_selectors(SpecSetup(algorithm, None, "/ckpt"), has_mtp_layers=True, transport="distributed",
                          session=True)
    assert (plan.target, plan.mtp) == ("target", None)


def test_refused_combinations_name_the_fix():
    with pytest.raises(ValueError, match="--mtp-num-layers"):
        plan_selectors(NATIVE, has_mtp_layers=False, transport="distributed", session=True)
    with pytest.raises(ValueError, match="27718"):  # old SGLang: distributed never reaches the MTP draft
        plan_selectors(NATIVE, has_mtp_layers=True, transport="distributed", session=False)
    with pytest.raises(ValueError, match="1177"):  # disk reloads every runner, so the external draft too
        plan_selectors(STANDALONE, has_mtp_layers=False, transport="disk", session=True)
    with pytest.raises(ValueError, match="1177"):  # old SGLang tensor path loads every runner
        plan_selectors(EAGLE3, has_mtp_layers=False, transport="tensor", session=False)
    # and what old SGLang can do safely
    assert plan_selectors(NATIVE, True, "tensor", session=False).mtp == "all"
    assert plan_selectors(EAGLE3, False, "distributed", session=False).target == "target"


# ---- protocol detection ----

@pytest.mark.parametrize("version,status,session", [
    ("0.5.23", 405, True), ("0.5.23", None, True), ("0.6.0", None, True), ("0.5.22", None, False),
    ("0.4.6.post4", None, False), ("0.4.6.post4", 404, False), (None, 405, True), ("0.5.23", 404, False),
    ("0.5.0rc2", None, False)])
def test_detect_protocol(version, status, session):
    assert protocol.detect_protocol(version, status).session is session


def test_detect_protocol_without_any_evidence_is_an_error():
    with pytest.raises(ValueError, match="version"):
        protocol.detect_protocol(None, 500)


# ---- payloads: every body builds SGLang's own io_struct class ----

@pytest.mark.parametrize("route,payload", [
    ("/begin_weight_update", protocol.begin_payload("all")),
    ("/end_weight_update", protocol.end_payload()),
    ("/init_weights_update_group", protocol.init_group_payload("127.0.0.1", 29500, 1, 3, "g", "gloo")),
    ("/destroy_weights_update_group", protocol.destroy_group_payload("g")),
    ("/update_weights_from_distributed", protocol.distributed_payload(
        ["a"], ["float32"], [[2, 3]], group_name="g", selector="target", weight_version="3", flush_cache=False,
        session=True)),
    ("/update_weights_from_distributed", protocol.distributed_payload(
        ["a"], ["bfloat16"], [[2]], group_name="g", selector="all", weight_version=None, flush_cache=True,
        session=False)),
    ("/update_weights_from_tensor", protocol.tensor_payload(["QUJD"], selector="all", weight_version="1",
                                                            flush_cache=False, session=True)),
    ("/update_weights_from_disk", protocol.disk_payload("/tmp/x", weight_version="1", session=True)),
    ("/update_weights_from_disk", protocol.disk_payload("/tmp/x", weight_version="1", session=False)),
    ("/weights_checker", protocol.checksum_payload("draft")),
    ("/get_weights_by_name", protocol.get_weights_payload("lm_head.weight", 10)),
    ("/pause_generation", protocol.pause_payload()),
    ("/continue_generation", protocol.continue_payload()),
])
def test_payloads_match_io_struct(route, payload):
    validate_payload(protocol.ROUTE_STRUCTS[route], payload)


def test_sessionless_payloads_carry_no_selector():
    assert "selector" not in protocol.distributed_payload(["a"], ["float32"], [[1]], group_name="g", selector="all",
                                                          weight_version=None, flush_cache=True, session=False)
    assert "selector" not in protocol.tensor_payload(["x"], selector="target", weight_version=None,
                                                     flush_cache=True, session=False)


# ---- verification ----

def test_fused_names_and_parts():
    assert verify.fused_name("model.layers.0.self_attn.k_proj.weight") == "model.layers.0.self_attn.qkv_proj.weight"
    assert verify.fused_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    assert verify.fused_name("model.layers.0.mlp.down_proj.weight") is None
    assert verify.stacked_parts("m.0.self_attn.qkv_proj.bias") == [
        "m.0.self_attn.q_proj.bias", "m.0.self_attn.k_proj.bias", "m.0.self_attn.v_proj.bias"]


def test_checksum_is_sglang_cpu_tensor_hash_and_stacking_views_copies_nothing():
    from slime_spec.weight_sync.verify.sglang_params import checksum, stacked
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(1, 3)
    digest = hashlib.sha256(a.numpy().tobytes()).digest()[:8]
    assert checksum(a) == f"{int.from_bytes(digest, 'big'):016x}"  # on CPU: the first 8 bytes of a sha256
    fused = torch.cat([a, b])
    assert torch.equal(stacked([a, b]), fused)
    views = [fused[:2], fused[2:]]  # as the engine's fused q/k/v: parts that are rows of one tensor
    assert stacked(views).data_ptr() == fused.data_ptr() and torch.equal(stacked(views), fused)


def test_coverage_maps_fused_and_draft_names():
    served = {"target": {"model.layers.0.self_attn.qkv_proj.weight": "1", "lm_head.weight": "2",
                         "model.layers.0.self_attn.rotary_emb.cos_sin_cache": "3"},
              "draft": {"model.enorm.weight": "4", "model.decoder.mlp.gate_up_proj.weight": "5"}}
    sent = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight", "lm_head.weight", "model.layers.1.enorm.weight",
            "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    cov = verify.check_coverage(served, sent, {"target", "draft"})
    assert cov.ok and cov.written == {"target": 3, "draft": 2}
    cov = verify.check_coverage(served, sent - {"model.layers.0.self_attn.v_proj.weight"}, {"target"})
    assert cov.missing == {"target": ["model.layers.0.self_attn.qkv_proj.weight"]}
    assert "draft" not in cov.missing  # the draft runner was not updated, so not checked


def test_served_checksums_name_and_compare_what_sglang_serves():
    """The trainer side names each checksum as SGLang serves it (fused, MTP block renamed, vocabulary padded with
    zeros) and compare_checksums catches one changed weight (conformance: tests/conformance/test_weight_checker)."""
    from slime_spec.weight_sync.verify.sglang_params import RunnerLayout, ServedChecksums, checksum
    q, k, v = torch.randn(4, 2), torch.randn(2, 2), torch.randn(2, 2)
    embed = torch.randn(100, 2)
    rec = ServedChecksums({"target": RunnerLayout.target({"tie_word_embeddings": True}, torch.float32),
                           "draft": RunnerLayout.mtp_draft({}, torch.float32)})
    for name, t in (("model.layers.0.self_attn.q_proj.weight", q), ("model.layers.0.self_attn.k_proj.weight", k),
                    ("model.mtp_layers.0.self_attn.q_proj.weight", q), ("model.layers.0.self_attn.v_proj.weight", v),
                    ("model.embed_tokens.weight", embed), ("lm_head.weight", embed),
                    ("model.mtp_layers.0.input_proj.weight", q)):
        rec.add(name, t)
    fused = "model.layers.0.self_attn.qkv_proj.weight"
    assert sorted(rec.checksums["target"]) == ["model.embed_tokens.weight", fused]  # tied: no lm_head
    assert sorted(rec.checksums["draft"]) == ["lm_head.weight", "model.embed_tokens.weight", "model.input_proj.weight"]
    assert rec.incomplete() == ["draft:model.mtp_block.self_attn.qkv_proj.weight"]
    padded = torch.cat([embed, torch.zeros(28, 2)])  # SGLang pads the vocabulary to a multiple of 64
    served = {"target": {fused: checksum(torch.cat([q, k, v])), "model.embed_tokens.weight": checksum(padded)}}
    assert verify.compare_checksums(served, rec.checksums, {"target"}) == []
    served["target"][fused] = checksum(torch.cat([q, k, v + 1]))
    assert verify.compare_checksums(served, rec.checksums, {"target"}) == [
        f"target:{fused} (engine {served['target'][fused]}, trainer {rec.checksums['target'][fused]})"]
    del served["target"][fused]
    assert "not served" in verify.compare_checksums(served, rec.checksums, {"target"})[0]


def test_served_by_role_splits_draft_prefix():
    reply = {"ranks": [{"checksums": {"a.weight": "1", "draft.b.weight": "2", "draft_step_0.c": "3"},
                        "per_gpu_checksum": "x", "parallelism_info": [{"tp_size": 1}]}]}
    assert verify.served_by_role(reply) == {"target": {"a.weight": "1"}, "draft": {"b.weight": "2"},
                                            "draft_step_0": {"c": "3"}}
    with pytest.raises(ValueError, match="ranks"):
        verify.served_by_role({"success": False, "message": "boom"})


# ---- canary ----

def test_accept_length_sums_raw_counters():
    metas = [{"completion_tokens": 30, "spec_verify_ct": 10}, {"completion_tokens": 2, "spec_verify_ct": 2}]
    assert canary.accept_length(metas) == pytest.approx(32 / 12)
    assert canary.accept_length([{"completion_tokens": 5}]) == 1.0


@pytest.mark.parametrize("spec,event,cause", [(NATIVE, "sync", "27718"), (NATIVE, "resume", "31674")])
def test_collapse_is_an_error_only_where_the_cause_is_recorded(spec, event, cause):
    """A sync made to skip the MTP tensors: acceptance falls from 2.5 to about 1.0 on the same prompts, and the
    sync's record (no MTP tensor sent) names the cause; after a resume the resume is the cause."""
    skipped_mtp = canary.SyncRecord(draft_tensors_sent=0, coverage_checked=True)
    verdict = canary.judge_canary(1.02, spec, event, before=2.5, record=skipped_mtp)
    assert verdict.level == "error" and cause in verdict.message and "2.500 before" in verdict.message
    assert "weight_sync_mtp_params=0" in verdict.message or event == "resume"


def test_a_fall_after_a_verified_sync_does_not_blame_the_draft_update():
    verified = canary.SyncRecord(draft_tensors_sent=16, coverage_checked=True)
    verdict = canary.judge_canary(1.02, NATIVE, "sync", before=2.5, record=verified)
    assert verdict.level == "warning" and "not updated" not in verdict.message
    assert "verified every tensor" in verdict.message
    unverified = canary.judge_canary(1.02, NATIVE, "sync", before=2.5,
                                     record=canary.SyncRecord(draft_tensors_sent=16, coverage_checked=False))
    assert unverified.level == "warning" and "not known" in unverified.message
    external = canary.judge_canary(1.02, STANDALONE, "sync", before=2.5)
    assert external.level == "warning" and "1177" in external.message


def test_an_untrained_draft_is_no_collapse():
    """A fresh random MTP layer: about 1.0 before and after the sync (the quickstart's small-machine run)."""
    for before in (None, 1.058):
        verdict = canary.judge_canary(1.058, NATIVE, "sync", before=before,
                                      record=canary.SyncRecord(draft_tensors_sent=16, coverage_checked=True))
        assert verdict.level == "untrained" and "collapse" not in verdict.message


def test_the_canary_probes_an_engine_with_one_batched_generate():
    """SGLang's /generate takes a list of prompts and answers a JSON list (EngineClient: {"result": [...]}); the
    probe's prompts go in one request and decode together."""
    class RecordingClient:  # test double of fleet.client.EngineClient.post
        def __init__(self):
            self.calls = []

        def post(self, path, payload):
            self.calls.append((path, payload))
            return {"result": [{"meta_info": {"completion_tokens": 8, "spec_verify_ct": 4}},
                               {"meta_info": {"completion_tokens": 8, "spec_verify_ct": 2}}]}

    probe = canary.AcceptanceCanary(NATIVE)
    probe.set_probe_from_samples([[1, 2, 3], [4, 5]])
    client = RecordingClient()
    assert probe._probe_engine(client) == pytest.approx(16 / 6)
    [(path, payload)] = client.calls
    assert path == "/generate" and payload["input_ids"] == [[1, 2, 3], [4, 5]]
    assert payload["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}


def test_an_untrained_draft_is_reported_once(monkeypatch, caplog):
    probe = canary.AcceptanceCanary(NATIVE)
    probe.set_probe_from_samples([[1, 2, 3]])
    monkeypatch.setattr(probe, "_probe_engine", lambda client: 1.05)
    with caplog.at_level("WARNING", logger=canary.__name__):
        probe.read_before([None])
        readings = [probe.run([None], "sync", {"weight_sync_mtp_params": 16, "weight_sync_covered": 1})
                    for _ in range(3)]
    assert [r["spec_canary_accept_length_before"] for r in readings] == [1.05] * 3
    assert probe.last_verdict.level == "untrained"
    assert [r.getMessage().count("untrained draft") for r in caplog.records] == [1]


def test_colocated_collapse_of_an_external_draft_also_names_resume():
    message = canary.judge_canary(1.0, STANDALONE, "sync", before=2.5, colocated=True).message
    assert "1177" in message and "31674" in message
    native = canary.SyncRecord(draft_tensors_sent=0, coverage_checked=True)
    assert "31674" not in canary.judge_canary(1.0, NATIVE, "sync", before=2.5, colocated=True, record=native).message


def test_canary_ok_warning_and_off():
    assert canary.judge_canary(2.4, NATIVE, "sync", before=2.5).level == "ok"
    assert canary.judge_canary(1.5, NATIVE, "sync", before=2.5).level == "warning"
    assert canary.judge_canary(1.0, SpecSetup(None), "sync").level == "off"


# ---- engine timing ----

def test_engine_seconds_take_the_slowest_engine_and_zero_where_none_reports():
    from slime_spec.weight_sync.transports.http_transports import engine_seconds
    fast = {"success": True, "slime_spec_engine_timing": {"receive_s": 0.1, "load_s": 0.4}}
    slow = {"success": True, "slime_spec_engine_timing": {"receive_s": 0.3, "load_s": 0.2}}
    assert engine_seconds([fast, slow]) == (0.3, 0.4)  # engines work side by side
    assert engine_seconds([{"success": True, "message": "Success"}]) == (0.0, 0.0)  # SGLang reports none
    assert engine_seconds([]) == (0.0, 0.0)


def test_engine_timing_is_read_from_the_message_the_embedded_engine_tags():
    """SGLang's reply structs carry only success and message: the embedded engine appends its timing to the message
    (EngineTiming.tagged), SGLang appends its own sentence after it, and the trainer reads it back."""
    from slime_spec.engine.weights.receive import TIMING_TAG, EngineTiming
    from slime_spec.weight_sync.transports import http_transports as ht
    assert ht.TIMING_TAG == TIMING_TAG  # one spelling on both sides (the trainer does not import the engine)
    message = EngineTiming(receive_s=0.25, load_s=0.5, snapshot_copied_bytes=8).tagged("Succeeded.")
    reply = {"success": True, "message": message + " Weight version updated to v1."}
    assert ht.engine_seconds([reply]) == (0.25, 0.5)
    assert ht.engine_timing([reply], "snapshot_copied_bytes") == 8
    assert ht.reported_timing({"message": TIMING_TAG + "{not json"}) is None


def test_judge_recognises_the_checkpoint_without_a_verified_previous_state():
    from slime_spec.weight_sync.verify.served_state import ServedState, judge
    checkpoint = ServedState("default", {"a": "1", "b": "2"})
    assert judge("u", ServedState("default", {"a": "1", "b": "2"}), None, checkpoint).serves == "checkpoint"
    assert judge("u", ServedState("7", {"a": "1", "b": "9"}), None, checkpoint).serves == "unverified"
    assert judge("u", ServedState("7", {"a": "1", "b": "9"}), ServedState("7", {"a": "1", "b": "9"}),
                 checkpoint).serves == "previous"
@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_trained_external_draft_gets_its_own_tensors_with_selector_draft(transport):
    plan = plan_selectors(EAGLE3, has_mtp_layers=False, transport=transport, session=True, trains_draft=True)
    assert (plan.target, plan.mtp, plan.draft) == ("target", None, "draft")
    assert protocol.session_selector(plan) == "all"


def test_trained_draft_refusals_name_the_fix():
    with pytest.raises(ValueError, match="--enable-draft-training.*EAGLE3"):
        plan_selectors(NATIVE, has_mtp_layers=True, transport="tensor", session=True, trains_draft=True)
    with pytest.raises(ValueError, match="0.5.23"):
        plan_selectors(EAGLE3, has_mtp_layers=False, transport="distributed", session=False, trains_draft=True)
    with pytest.raises(ValueError, match="--weight-sync-transport distributed or tensor"):
        plan_selectors(EAGLE3, has_mtp_layers=False, transport="disk", session=True, trains_draft=True)


def test_draft_tensors_written_maps_checkpoint_names_onto_served_ones():
    sent = {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
            "midlayer.self_attn.v_proj.weight", "lm_head.weight"}
    served = {"target": {"lm_head.weight": "t"},
              "draft": {"model.fc.weight": "a", "model.midlayer.self_attn.qkv_proj.weight": "b",
                        "lm_head.weight": "c", "model.embed_tokens.weight": "t"}}
    assert verify.draft_tensors_written(served, sent) == {"draft": sent}
    assert verify.draft_tensors_written(served, sent | {"midlayer.mlp.up_proj.weight"})["draft"] == sent
    assert verify.written_by_draft_sync("draft.model.fc.weight", sent)
    assert not verify.written_by_draft_sync("draft.model.embed_tokens.weight", sent)
    assert not verify.written_by_draft_sync("lm_head.weight", sent)  # a target name is never the draft's
