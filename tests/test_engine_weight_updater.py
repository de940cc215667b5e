"""Weight routes of the embedded engine, with this test process as the trainer (rank 0 of a gloo group).

The requests run through SGLang's own SchedulerWeightUpdaterManager over our runners (engine/weights/updater.py);
the in-process tests at the end drive that manager with SGLang's request structs. One EAGLE server on a tiny MiMo
checkpoint (its MTP layer is the draft). Every test that changes weights restores the checkpoint from disk at the
end (`/update_weights_from_disk`). Routes, request checks and reply shapes are SGLang's (its front end runs
unchanged); checksums are SGLang's WeightChecker's, keyed by the names SGLang's model classes serve (fused
qkv_proj; MiMoMTP's own `model.` names, prefixed `draft.`).
"""

import base64
import hashlib
import pickle
import threading
import time

import pytest
import requests
import torch
from safetensors.torch import load_file

from slime_spec.common.dist_group import WeightUpdateGroup
from slime_spec.common.net import free_port
from slime_spec.engine import sglang_stand_ins
from slime_spec.fleet.process import embedded_server_process
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.weight_sync.transports.http_transports import reported_timing
from slime_spec.weight_sync.transports.tensor_payload import serialize_named_tensors
from slime_spec.weight_sync.verify.sglang_params import MIMO_MTP, RunnerLayout, served_name
from tests.helpers.engine_weights import (
    abort,
    begin,
    engine_weights,
    request,
    served_bytes,
    tensor_update,
    update_bucket,
)

PROMPTS = ["hello world", "the cat sat on", "abc abc abc", "Once upon a time"]
NORM = "model.norm.weight"
MTP_NORM = "model.mtp_layers.0.final_layernorm.weight"
DRAFT_NORM = "draft." + served_name(MTP_NORM, RunnerLayout(MIMO_MTP, False))[0]  # its /weights_checker key


def sglang_hash(t: torch.Tensor) -> str:
    """SGLang's WeightChecker hash of one served tensor."""
    sglang_stand_ins.install()
    from sglang.srt.utils.weight_checker import _hash_tensor

    return _hash_tensor(t)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("engine_weights") / "mimo", arch="mimo", hidden_size=32,
                           num_layers=2, seed=5)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine_weights_log") / "server.log"
    with embedded_server_process(model, ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                                         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                                         "--random-seed", "0"], log_path=log).start(300) as s:
        yield s


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=120)


def ok(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 200 and r.json()["success"], r.text
    return r.json()


def outputs(server):
    outs = post(server, "/generate", {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 16,
                                                                          "ignore_eos": True}}).json()
    return [o["output_ids"] for o in outs], sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs), outs


def checksums(server, selector="all"):
    out = ok(server, "/weights_checker", {"action": "checksum", "selector": selector})
    return out["ranks"][0]["checksums"]


@pytest.fixture(scope="module")
def trainer(server):
    """This process as rank 0 of the engine's weight-update group (gloo, world size 2)."""
    port = free_port()
    reply = {}
    init = threading.Thread(target=lambda: reply.setdefault("r", post(server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "wug", "backend": "gloo"})))
    init.start()
    group = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=2, group_name="wug", backend="gloo",
                              timeout_s=60)
    init.join(timeout=60)
    assert reply["r"].json() == {"success": True, "message": "Succeeded to initialize custom process group."}
    yield group
    group.destroy()


@pytest.fixture
def restore(server, model):
    yield
    out = ok(server, "/update_weights_from_disk", {"model_path": str(model)})
    assert out["num_paused_requests"] == 0


def push(server, group, named, selector, **extra):
    """The trainer's side of /update_weights_from_distributed: post the metadata, broadcast each tensor."""
    body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": "wug", "selector": selector, **extra}
    reply = {}
    thread = threading.Thread(target=lambda: reply.setdefault("r", post(server, "/update_weights_from_distributed",
                                                                         body)))
    thread.start()
    for _, t in named:
        group.broadcast(t.contiguous(), src=0)
    thread.join(timeout=120)
    return reply["r"]


def test_updates_need_a_session(server):
    r = post(server, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []})
    assert r.status_code == 400 and r.json() == {
        "success": False,
        "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"}
    r = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="]})
    assert r.json()["message"] == ("update_weights_from_tensor must run between begin_weight_update() and "
                                   "end_weight_update()")
    assert post(server, "/end_weight_update", {}).json()["message"] == (
        "no weight-update session is open; call begin_weight_update() first")
    ok(server, "/begin_weight_update", {"selector": "all"})
    assert post(server, "/begin_weight_update", {}).json()["message"] == (
        "a weight-update session is already open; call end_weight_update() first")
    r = post(server, "/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                                          "group_name": "nope"})
    assert r.status_code == 400 and r.json()["message"].startswith("Failed to receive weights: Group nope not in")
    end_rolled_back(server)  # a failed update fails its session
    r = post(server, "/begin_weight_update", {"selector": "everything"})
    assert r.status_code == 400 and "selector" in r.text  # SGLang's request struct: a Literal


def test_nccl_on_a_cpu_engine_is_refused(server):
    r = post(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(),
                                                    "rank_offset": 1, "world_size": 2, "group_name": "n"})
    assert r.status_code == 400 and not r.json()["success"] and "gloo" in r.json()["message"]
    assert post(server, "/destroy_weights_update_group", {"group_name": "n"}).json() == {
        "success": False, "message": "The group to be destroyed does not exist."}


def test_target_update_then_mtp_only_update(server, trainer, restore):
    base_ids, base_accept, _ = outputs(server)
    base_sums = checksums(server)
    assert DRAFT_NORM in base_sums

    ok(server, "/begin_weight_update", {"selector": "target"})
    r = push(server, trainer, [(NORM, torch.zeros(32))], "target", weight_version="v1")
    message = r.json()["message"]
    assert r.json()["success"] and message.startswith("Succeeded to update parameter online. ") \
        and message.endswith(" Weight version updated to v1."), message
    assert reported_timing(r.json())["direct_tensors"] == 1  # the engine's timing rides in SGLang's message
    ok(server, "/end_weight_update", {})
    ids, accept, outs = outputs(server)
    assert ids != base_ids and all(t == 0 for row in ids for t in row)  # a zero final norm: logits 0, argmax 0
    assert outs[0]["meta_info"]["weight_version"] == "v1"
    sums = checksums(server)
    assert sums[NORM] != base_sums[NORM]
    assert {k: v for k, v in sums.items() if k.startswith("draft.")} == \
        {k: v for k, v in base_sums.items() if k.startswith("draft.")}  # "target" never reaches the draft

    # An MTP tensor is the draft's: selector "target" cannot load it, and nothing changes.
    ok(server, "/begin_weight_update", {"selector": "target"})
    r = push(server, trainer, [(MTP_NORM, torch.zeros(32))], "target")
    assert r.status_code == 400 and MTP_NORM in r.json()["message"]
    assert "keep serving" in r.json()["message"]
    end_rolled_back(server)
    ok(server, "/begin_weight_update", {"selector": "draft"})
    r = push(server, trainer, [(MTP_NORM, torch.zeros(32))], "draft")
    assert r.json()["success"]
    ok(server, "/end_weight_update", {})
    new_ids, new_accept, outs = outputs(server)
    assert new_ids == ids  # the draft never changes greedy outputs
    assert new_accept > accept  # ... but it now drafts token 0, which the target always picks
    assert all(o["meta_info"]["spec_accept_length"] == 4 for o in outs)
    sums_after = checksums(server)
    assert sums_after[DRAFT_NORM] != sums[DRAFT_NORM]
    assert {k: v for k, v in sums_after.items() if not k.startswith("draft.")} == \
        {k: v for k, v in sums.items() if not k.startswith("draft.")}


def test_failed_update_keeps_the_old_weights_serving(server, trainer, model, restore):
    base_ids, _, _ = outputs(server)
    ok(server, "/begin_weight_update", {})
    named = [(NORM, torch.zeros(32)), ("model.embed_tokens.weight", torch.zeros(3, 3)),
             ("lm_head.weight", torch.zeros(101, 32))]
    r = push(server, trainer, named, "all")
    assert r.status_code == 400 and "model.embed_tokens.weight" in r.json()["message"]
    end_rolled_back(server)
    assert outputs(server)[0] == base_ids
    served = post(server, "/get_weights_by_name", {"name": NORM, "truncate_size": 100}).json()
    assert served == load_file(str(model / "model.safetensors"))[NORM].tolist()


def test_update_from_tensor_plain_and_flattened_bucket(server, restore):
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    base_ids, _, _ = outputs(server)
    ok(server, "/begin_weight_update", {})
    payload = serialize_named_tensors([(NORM, torch.zeros(32))])
    assert ok(server, "/update_weights_from_tensor", {"serialized_named_tensors": [payload], "selector": "target"})[
        "message"].startswith("Success")
    assert all(t == 0 for row in outputs(server)[0] for t in row)
    bucket = FlattenedTensorBucket(named_tensors=[(NORM, torch.ones(32)), (MTP_NORM, torch.ones(32))])
    # What SGLang's producers send with load_format "flattened_bucket": one flat tensor and its metadata.
    blob = base64.b64encode(pickle.dumps({"flattened_tensor": bucket.get_flattened_tensor(),
                                          "metadata": bucket.get_metadata()})).decode()
    ok(server, "/update_weights_from_tensor", {"serialized_named_tensors": [blob], "load_format": "flattened_bucket"})
    ok(server, "/end_weight_update", {})
    assert outputs(server)[0] != base_ids
    assert post(server, "/get_weights_by_name", {"name": NORM}).json() == [1.0] * 32
    ok(server, "/begin_weight_update", {})
    r = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["bm90IGEgcGlja2xl"]})
    assert r.status_code == 400 and "Failed to deserialize" in r.json()["message"]
    end_rolled_back(server)


def test_weights_checker_runs_only_what_sglangs_reply_carries(server):
    """`names` (a slime-spec extension) has no place in SGLang's CheckWeightsReqOutput: refused with the reason;
    actions on the model's own memory (compare) are refused by name."""
    r = post(server, "/weights_checker", {"action": "names", "selector": "all"})
    assert r.status_code == 400 and "'checksum'" in r.json()["message"]
    r = post(server, "/weights_checker", {"action": "compare"})
    assert r.status_code == 400 and "'compare'" in r.json()["message"]


def test_in_place_receive_converts_a_different_dtype_through_a_buffer(server, trainer, restore):
    """float64 into a float32 weight: received into a buffer and converted; the float32 one lands in place."""
    ok(server, "/begin_weight_update", {"selector": "all"})
    r = push(server, trainer, [(NORM, torch.full((32,), 0.5, dtype=torch.float64)), (MTP_NORM, torch.zeros(32))],
             "all")
    assert r.json()["success"]
    ok(server, "/end_weight_update", {})
    assert post(server, "/get_weights_by_name", {"name": NORM}).json() == [0.5] * 32
    assert checksums(server, "draft")[DRAFT_NORM] == sglang_hash(torch.zeros(32))


def end_rolled_back(server):
    """SGLang's manager ends a session whose update failed like any other (the failed update's own reply said the
    session was rolled back); the next end finds no session."""
    r = post(server, "/end_weight_update", {})
    assert r.status_code == 200 and r.json() == {"success": True, "message": "Success"}, r.text
    assert post(server, "/end_weight_update", {}).status_code == 400


def test_a_session_that_fails_half_way_rolls_back_every_bucket(server, trainer, model, restore):
    """Bucket 1 lands (outputs change), bucket 2 fails: the weights from before the session serve again."""
    base_ids, _, _ = outputs(server)
    base_sums = checksums(server)
    ok(server, "/begin_weight_update", {"selector": "all"})
    assert push(server, trainer, [(NORM, torch.zeros(32)), (MTP_NORM, torch.zeros(32))], "all").status_code == 200
    assert outputs(server)[0] != base_ids  # the first bucket is live inside the session
    r = push(server, trainer, [("model.layers.0.mlp.up_proj.weight", torch.zeros(7, 7))], "all")
    assert r.status_code == 400 and "rolled back" in r.json()["message"]
    assert outputs(server)[0] == base_ids and checksums(server) == base_sums
    # the rest of a failed session is refused (its broadcast still completes)
    r = push(server, trainer, [(NORM, torch.ones(32))], "all")
    assert r.status_code == 400 and "earlier update of this session failed" in r.json()["message"]
    end_rolled_back(server)
    assert checksums(server) == base_sums


def test_abort_weight_update_rolls_back_a_healthy_session(server, trainer, restore):
    """What the syncer does when another engine failed: this engine's completed buckets are undone too."""
    base_sums = checksums(server)
    ok(server, "/begin_weight_update", {"selector": "all"})
    assert push(server, trainer, [(NORM, torch.zeros(32))], "all").status_code == 200
    out = ok(server, "/abort_weight_update", {})
    assert out["rolled_back"] is True and checksums(server) == base_sums
    assert post(server, "/end_weight_update", {}).status_code == 400  # the session is closed
    assert ok(server, "/abort_weight_update", {})["rolled_back"] is False


def test_disk_update_restores_and_checksums_match_the_checkpoint(server, model, restore):
    files = load_file(str(model / "model.safetensors"))
    sums = checksums(server, "target")
    assert not any(k.startswith("draft.") for k in sums)
    assert sums[NORM] == sglang_hash(files[NORM])
    attn = "model.layers.0.self_attn."  # SGLang serves q, k and v fused, in that order
    qkv = torch.cat([files[f"{attn}{p}_proj.weight"] for p in "qkv"])
    assert sums[f"{attn}qkv_proj.weight"] == sglang_hash(qkv)
    draft = checksums(server, "draft")
    assert draft and all(k.startswith("draft.") for k in draft)
    assert draft[DRAFT_NORM] == sglang_hash(files[MTP_NORM])
    full = ok(server, "/weights_checker", {"action": "checksum"})
    rank = full["ranks"][0]
    assert full["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
    assert [p["role"] for p in rank["parallelism_info"]] == ["target", "draft"]
    r = post(server, "/weights_checker", {"action": "compare"})
    assert r.status_code == 400 and not r.json()["success"]
    assert post(server, "/get_weights_by_name", {"name": "no.such.weight"}).json() == {
        "error": {"message": "Get parameter by name failed"}}
    assert len(post(server, "/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 3}).json()) == 3
    r = post(server, "/update_weights_from_disk", {"model_path": str(model / "nowhere")})
    assert r.status_code == 400 and r.json()["num_paused_requests"] == 0


def test_destroy_group_last(server, trainer):
    assert ok(server, "/destroy_weights_update_group", {"group_name": "wug"})["message"] == (
        "Succeeded to destroy custom process group.")


def _long_request(server, max_new=300):
    reply = {}
    body = {"text": "long running", "sampling_params": {"temperature": 0, "max_new_tokens": max_new,
                                                         "ignore_eos": True}}
    thread = threading.Thread(target=lambda: reply.setdefault("r", post(server, "/generate", body).json()))
    thread.start()
    deadline = time.monotonic() + 30
    while requests.get(server.url + "/server_info", timeout=10).json()["internal_states"][0]["num_running_reqs"] != 1:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.02)
    return thread, reply


def test_running_requests_finish_on_the_old_weights(server, restore):
    reference = post(server, "/generate", {"text": "long running", "sampling_params": {
        "temperature": 0, "max_new_tokens": 300, "ignore_eos": True}}).json()["output_ids"]
    thread, reply = _long_request(server)
    ok(server, "/begin_weight_update", {})  # waits for the running request, as SGLang's writer lock does
    ok(server, "/update_weights_from_tensor", {"serialized_named_tensors": [
        serialize_named_tensors([(NORM, torch.zeros(32))])]})
    ok(server, "/end_weight_update", {})
    thread.join(timeout=60)
    assert reply["r"]["output_ids"] == reference
    assert all(t == 0 for row in outputs(server)[0] for t in row)


def test_abort_all_requests_and_updates_while_paused(server, restore):
    ok(server, "/begin_weight_update", {"selector": "all"})
    thread, reply = _long_request(server)
    ok(server, "/update_weights_from_tensor", {"serialized_named_tensors": [serialize_named_tensors([
        (NORM, torch.ones(32))])], "abort_all_requests": True})
    thread.join(timeout=60)
    assert reply["r"]["meta_info"]["finish_reason"]["type"] == "abort"

    thread, reply = _long_request(server)
    assert post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200
    r = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [serialize_named_tensors([
        (NORM, torch.zeros(32))])]})  # applied at once while paused, but the flush is refused (SGLang)
    assert r.status_code == 400 and r.json()["message"].startswith("Weights were updated, but the cache was not")
    ok(server, "/end_weight_update", {})
    assert post(server, "/continue_generation", {}).status_code == 200
    thread.join(timeout=60)
    assert reply["r"]["meta_info"]["completion_tokens"] == 300
    assert reply["r"]["output_ids"][-5:] == [0] * 5  # continued on the new weights


def test_an_error_inside_a_session_fails_it_and_rolls_back(server, restore):
    """A payload that deserializes but is not (name, tensor) pairs raised TypeError past the session before."""
    base_sums = checksums(server)
    ok(server, "/begin_weight_update", {})
    ok(server, "/update_weights_from_tensor", {"serialized_named_tensors": [
        serialize_named_tensors([(NORM, torch.zeros(32))])], "selector": "target"})
    assert checksums(server) != base_sums
    not_pairs = base64.b64encode(pickle.dumps([1, 2])).decode()
    r = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [not_pairs]})
    assert r.status_code == 400 and "TypeError" in r.json()["message"] and "rolled back" in r.json()["message"]
    end_rolled_back(server)
    assert checksums(server) == base_sums


def test_a_corrupt_checkpoint_is_a_400_naming_the_file(server, tmp_path):
    base_sums = checksums(server)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    r = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert r.status_code == 400 and "model.safetensors is not a readable safetensors file" in r.json()["message"]
    assert r.json()["num_paused_requests"] == 0 and checksums(server) == base_sums


def test_a_disk_update_in_a_failed_session_is_refused(server, model, tmp_path):
    """Every route loads through one place, and there a session whose earlier update failed refuses the rest: a
    good checkpoint after a corrupt one used to load, and end_weight_update then said the old weights served."""
    base_sums = checksums(server)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    ok(server, "/begin_weight_update", {})
    assert post(server, "/update_weights_from_disk", {"model_path": str(tmp_path)}).status_code == 400
    r = post(server, "/update_weights_from_disk", {"model_path": str(model)})
    assert r.status_code == 400 and "an earlier update of this session failed" in r.json()["message"]
    end_rolled_back(server)
    assert checksums(server) == base_sums




def test_the_reply_comes_after_the_device_has_finished_the_copies(model, monkeypatch):
    """On CUDA the copy out of a CUDA-IPC bucket is queued on the device; the sender may free or reuse that memory
    the moment it reads the reply, so the update settles the device after the copy and before replying.
    `settle` (torch.cuda.synchronize) is the one piece that cannot run here: it is replaced by a recorder."""
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.engine.weights import updater as wu
    core = EngineCore(str(model), None, max_running_requests=2)
    events = []
    monkeypatch.setattr(wu, "settle", lambda device: events.append(f"settle {device}"))
    real_load = core.load_weights
    monkeypatch.setattr(core, "load_weights", lambda named, selector="all": (real_load(named, selector),
                                                                             events.append("copy")))
    weights = engine_weights(core, "cuda")
    assert begin(weights, "target").success
    out = tensor_update(weights, "target", [(NORM, torch.zeros(32))])
    assert out.success, out
    assert events == ["copy", "settle cuda"]
    assert torch.equal(core.named_weights("target")[NORM], torch.zeros(32))


def test_a_failure_after_buckets_landed_restores_every_old_byte_from_the_host_mirror(model):
    """Session 1 lands (its rollback values copied to the host on the sync's path: the mirror is empty at start)
    and ends; its tensors are copied to the mirror in the background. Session 2 copies nothing on its path (the
    mirror holds what is served), lands two buckets, then a third is refused: every byte of every served tensor is
    as after session 1. No device memory is held at any point: the values live in host buffers."""
    from slime_spec.engine.managers.engine_core import EngineCore
    core = EngineCore(str(model), None, max_running_requests=2)
    target = core.named_weights("target")
    names = [n for n in target if n.startswith("model.layers.")][:4]
    nbytes = sum(target[n].numel() * target[n].element_size() for n in names)
    weights = engine_weights(core)
    assert begin(weights, "target").success
    first = [update_bucket(weights, bucket, 7.0, target) for bucket in (names[:2], names[2:])]
    assert sum(t["snapshot_copied_bytes"] for t in first) == nbytes
    assert sum(t["snapshot_mirrored_bytes"] for t in first) == 0
    assert weights.handle(request("EndWeightUpdateReqInput")).success
    before = served_bytes(core)
    assert begin(weights, "target").success  # waits for the background copies
    second = [update_bucket(weights, bucket, 9.0, target) for bucket in (names[:2], names[2:])]
    assert sum(t["snapshot_copied_bytes"] for t in second) == 0  # the mirror held every value
    assert sum(t["snapshot_mirrored_bytes"] for t in second) == nbytes
    assert torch.equal(core.named_weights("target")[names[0]], torch.full_like(target[names[0]], 9.0))
    bad = tensor_update(weights, "target", [(NORM, torch.zeros(3))])
    assert not bad.success and "were rolled back" in bad.message, bad
    after = served_bytes(core)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before), [k for k in before if not torch.equal(after[k],
                                                                                                     before[k])]
    assert all(t.device.type == "cpu" for t in weights.session.mirror.buffers.values())
    end = weights.handle(request("EndWeightUpdateReqInput"))
    assert (end.success, end.message) == (True, "Success")  # SGLang's manager closes the session as it always does
    assert not weights.session.open and all(torch.equal(served_bytes(core)[k], before[k]) for k in before)
    assert begin(weights, "target").success  # the rollback left the mirror equal to what is served
    assert update_bucket(weights, names, 3.0, target)["snapshot_copied_bytes"] == 0
    assert abort(weights).success
    assert all(torch.equal(served_bytes(core)[k], before[k]) for k in before)


def test_a_write_outside_a_session_is_copied_again_on_the_next_sync(model):
    """A load outside a session (a disk update) changes what is served behind the mirror's back: the mirror is
    dropped and the next session copies its rollback values on its own path, so a rollback restores the disk's."""
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.engine.weights.receive import EngineTiming
    core = EngineCore(str(model), None, max_running_requests=2)
    target = core.named_weights("target")
    name = next(n for n in target if n.startswith("model.layers."))
    weights = engine_weights(core)
    assert begin(weights, "target").success
    update_bucket(weights, [name], 7.0, target)
    assert weights.handle(request("EndWeightUpdateReqInput")).success
    loaded, _ = weights._load([(name, torch.full_like(target[name], 5.0))], "target", "ok", EngineTiming(), "disk")
    assert loaded
    assert begin(weights, "target").success
    assert update_bucket(weights, [name], 1.0, target)["snapshot_copied_bytes"] > 0
    assert abort(weights).success
    assert torch.equal(core.named_weights("target")[name], torch.full_like(target[name], 5.0))


def test_the_mirror_refresh_shares_one_buffer_per_storage_and_waits_before_use():
    from slime_spec.engine.weights.mirror import HostMirror
    mirror = HostMirror()
    shared, other = torch.arange(60.0), torch.arange(4.0)
    mirror.refresh([(("target", "e"), shared), (("draft", "e"), shared), (("target", "o"), other)])
    assert mirror.fresh == set()  # in flight: not fresh until waited for
    buf, copied = mirror.backup_of(("draft", "e"), shared)
    assert not copied and torch.equal(buf, torch.arange(60.0))
    assert mirror.buffers[("target", "e")] is mirror.buffers[("draft", "e")]
    assert mirror.host_bytes_held == 64 * 4
    shared.zero_()
    assert torch.equal(buf, torch.arange(60.0))  # a copy, not a view
    mirror.invalidate()
    assert mirror.backup_of(("target", "o"), other)[1]  # copied again


def test_a_tensor_both_runners_serve_is_snapshotted_once(model):
    """MiMo's MTP runner serves the target's embedding and lm_head: with selector "all" the snapshot keeps one copy
    of each (on MiMo-7B 2.5 GB less to copy per sync), and a rollback still restores both runners' view of it.
    SGLang's manager calls the target's loader and then the draft's: the update is loaded once, by the first."""
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.speculative.settings import SpecConfig
    core = EngineCore(str(model), SpecConfig("EAGLE", 2, 1, 3), max_running_requests=2)
    embed = "model.embed_tokens.weight"
    assert core.named_weights("draft")[embed].data_ptr() == core.named_weights("target")[embed].data_ptr()
    before = core.named_weights("target")[embed].clone()
    weights = engine_weights(core)
    assert [role for role, _ in weights.manager._select_runners("all")] == ["target", "draft"]
    assert begin(weights, "all").success
    reply = tensor_update(weights, "all", [(embed, torch.zeros_like(before))])
    assert reply.success, reply
    timing = weights.last_timing
    assert timing["snapshot_copied_bytes"] + timing["snapshot_mirrored_bytes"] == before.numel() * before.element_size()
    bad = tensor_update(weights, "all", [(NORM, torch.zeros(3))])
    assert not bad.success and "were rolled back" in bad.message, bad
    assert torch.equal(core.named_weights("draft")[embed], before)


def test_a_shared_tensor_reached_by_two_selectors_is_copied_once_and_restored_to_its_value_before_begin(model):
    """MiMo's embedding is served by the target and the MTP runner. Update 1 (selector target) writes it, update 2
    (selector draft) writes it again: the session keeps the one copy taken before update 1, so the rollback
    restores the value from before begin (a second copy, taken of update 1's value, was restored last), and
    the snapshot bytes the updates report equal the host memory the copies hold."""
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.speculative.settings import SpecConfig
    core = EngineCore(str(model), SpecConfig("EAGLE", 2, 1, 3), max_running_requests=2)
    embed = "model.embed_tokens.weight"
    before = core.named_weights("target")[embed].clone()
    weights = engine_weights(core)
    assert begin(weights, "all").success
    timings = []
    for selector, value in (("target", 0.0), ("draft", 1.0)):
        reply = tensor_update(weights, selector, [(embed, torch.full_like(before, value))])
        assert reply.success, reply
        timings.append(weights.last_timing)
    reported = [t["snapshot_copied_bytes"] + t["snapshot_mirrored_bytes"] for t in timings]
    assert reported == [before.numel() * before.element_size(), 0]  # the second update found its copy
    assert sum(t["snapshot_copied_bytes"] for t in timings) == weights.session.mirror.host_bytes_held
    assert torch.equal(core.named_weights("draft")[embed], torch.ones_like(before))
    aborted = abort(weights)
    assert aborted.success, aborted
    assert torch.equal(core.named_weights("target")[embed], before)
    assert torch.equal(core.named_weights("draft")[embed], before)


def test_an_in_place_update_decides_its_copies_once_and_counts_their_bytes_once(model, monkeypatch):
    """The in-place receive copies each tensor just before its broadcast lands, but which tensors the update
    must copy is decided once for all its names (one WeightSession.snapshot_for per update), and the bytes are
    counted where the copy is made, once."""
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.engine.weights import session as weight_session
    from slime_spec.engine.weights.receive import EngineTiming, receive_in_place
    core = EngineCore(str(model), None, max_running_requests=2)
    target = core.named_weights("target")
    names = [n for n in target if n.startswith("model.layers.")][:3]
    session = weight_session.WeightSession("cpu")
    session.begin("target", "v0")
    decided = []
    real = session.snapshot_for
    monkeypatch.setattr(session, "snapshot_for", lambda *a: decided.append(a[2]) or real(*a))

    class Group:  # rank 0's broadcast, as the receiving rank sees it
        def broadcast(self, buf, src):
            buf.fill_(3.0)

    timing = EngineTiming()
    specs = [(n, target[n].dtype, list(target[n].shape)) for n in names]
    metas = [torch.empty(shape, dtype=dtype, device="meta") for _, dtype, shape in specs]
    plan = core.plan_weights([(n, m) for (n, _, _), m in zip(specs, metas)], "target")
    snapshot = session.snapshot_for(core, "target", names, timing)
    receive_in_place(Group(), specs, "cpu", plan, metas, snapshot.take, timing)
    receive_in_place(Group(), specs[:1], "cpu", plan[:1], metas[:1], snapshot.take, timing)  # a repeated name
    assert decided == [names]
    assert timing.snapshot_copied_bytes == sum(target[n].numel() * target[n].element_size() for n in names)
    assert session.mirror.host_bytes_held == timing.snapshot_copied_bytes
    assert session.rollback(core) == len(names)
    assert all(not torch.all(core.named_weights("target")[n] == 3.0) for n in names)


def test_rollback_and_close_are_one_idempotent_path(model):
    """A failed update rolls the session back; the abort that follows (the syncer's) restores nothing twice,
    says how many tensors the session restored, and a second abort or end finds no session."""
    from slime_spec.engine.managers.engine_core import EngineCore
    core = EngineCore(str(model), None, max_running_requests=2)
    target = core.named_weights("target")
    name = next(n for n in target if n.startswith("model.layers."))
    before = target[name].clone()
    weights = engine_weights(core)
    assert begin(weights, "target").success
    assert tensor_update(weights, "target", [(name, torch.zeros_like(before))]).success
    bad = tensor_update(weights, "target", [(NORM, torch.zeros(3))])
    # the refused update's own tensor was copied before its load was refused: restored too, unchanged
    assert not bad.success and "2 earlier tensor write(s) were rolled back" in bad.message, bad
    assert torch.equal(core.named_weights("target")[name], before)
    assert weights.session.rollback(core) == 2  # nothing left to restore: the count stays the session's
    aborted = abort(weights)
    assert aborted.success and "rolled back 2 tensor(s)" in aborted.message, aborted
    assert not abort(weights).success
    end = weights.handle(request("EndWeightUpdateReqInput"))
    assert not end.success and end.message == "no weight-update session is open; call begin_weight_update() first"
    assert weights.session.close(core) == 2 and not weights.session.open
    assert torch.equal(core.named_weights("target")[name], before)


def test_a_malformed_tensor_payload_fails_the_update_not_the_engine(model):
    """SGLang's manager lets a payload that is not SGLang's pickle raise out of its handler; the embedded engine
    answers the update as failed instead (and fails the session), naming the cause."""
    from slime_spec.engine.managers.engine_core import EngineCore
    weights = engine_weights(EngineCore(str(model), None, max_running_requests=2))
    assert begin(weights, "target").success
    r = weights.handle(request("UpdateWeightsFromTensorReqInput", serialized_named_tensors=["bm90IGEgcGlja2xl"]))
    assert not r.success and "Failed to deserialize serialized_named_tensors" in r.message
    assert weights.session.error is not None


def test_runners_are_walked_once_per_session_and_a_release_inside_it_still_loads_in_place(model):
    """Inside a session the runner look-ups (snapshot, load plan) are cached: the same objects, equal to a fresh walk
    of the model. A memory release and resume inside the session swap the parameters' storage, not the parameters,
    so an update after it lands in what is served. The cache goes with the session."""
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.engine.weights import updater
    from slime_spec.speculative.settings import SpecConfig
    core = EngineCore(str(model), SpecConfig("EAGLE", 2, 1, 3), max_running_requests=2)
    weights = engine_weights(core)
    assert begin(weights, "all").success
    first = updater.select_runners(core.model, core.drafter, "all", core.session_runners)
    assert updater.select_runners(core.model, core.drafter, "all", core.session_runners) is first
    assert first == updater._walk_runners(core.model, core.drafter, "all")
    core.release_memory(None)
    core.resume_memory(None)
    new = torch.full_like(core.named_weights("target")[NORM], 0.5)
    assert tensor_update(weights, "all", [(NORM, new)]).success
    assert torch.equal(core.named_weights("target")[NORM], new)
    assert weights.handle(request("EndWeightUpdateReqInput")).success
    assert core.session_runners is None
    assert updater.select_runners(core.model, core.drafter, "all", core.session_runners) is not first
