"""Our weight-update sequence against SGLang 0.5.23's own session logic.

SGLang's `SchedulerWeightUpdaterManager` (scheduler_components/weight_updater.py) runs here for real:
session state, selector parsing and runner choice, the refusal of updates outside a session, and
each TP rank's deserialization (`TpModelWorker.deserialize_own_rank`). Test doubles stand in for
what needs a model or SGLang's processes: the HTTP -> tokenizer -> scheduler hop (`SchedulerHop`, which
builds each io_struct from our body as the route does and answers as the route would: 200 or 400),
the model runners (record what they are asked to load), and the TP group (a one-rank gloo group).
We test at this level rather than through SGLang's FastAPI app: its tokenizer manager needs the
scheduler processes.
"""

from __future__ import annotations

import types
from datetime import timedelta
from unittest import mock

import pytest
import torch

from slime_spec.common.dist_group import join_group
from slime_spec.common.net import free_port
from slime_spec.fleet.client import post_all
from slime_spec.weight_sync import protocol
from slime_spec.weight_sync.gather import Bucket, NamedTensor
from slime_spec.weight_sync.transports.http_transports import TensorTransport
from slime_spec.weight_sync.transports.tensor_payload import serialize_for_tp_ranks
from tests.conformance.sglang_io import build, io_struct


class RecordingRunner:
    """A model runner's weight updater (test double): records what it is asked to do."""

    def __init__(self, role: str):
        self.role, self.calls, self.loaded = role, [], {}
        self.weight_updater = self

    def begin_weight_update(self):
        self.calls.append("begin")

    def end_weight_update(self, *, run_post_load):
        self.calls.append("end")

    def update_weights_from_tensor(self, named_tensors, load_format=None):
        """A flattened bucket is rebuilt as SGLang's model runner does, with SGLang's own FlattenedTensorBucket."""
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        self.calls.append("load")
        if load_format == "flattened_bucket":
            named_tensors = FlattenedTensorBucket(flattened_tensor=named_tensors["flattened_tensor"],
                                                  metadata=named_tensors["metadata"]).reconstruct_tensors()
        self.loaded.update(dict(named_tensors))
        return True, "Success"


class StandInTpWorker:
    """The TP worker (test double) with SGLang's own per-rank deserialization."""

    def __init__(self, target: RecordingRunner, draft: RecordingRunner):
        from sglang.srt.managers.tp_worker import TpModelWorker

        self.target, self.draft_worker = target, types.SimpleNamespace(weight_update_runners=lambda: [("draft", draft)])
        self.deserialize_own_rank = types.MethodType(TpModelWorker.deserialize_own_rank, self)

    def weight_update_runners(self):
        return [("target", self.target)]


ROUTES = {"/begin_weight_update": "begin_weight_update", "/end_weight_update": "end_weight_update",
          "/update_weights_from_tensor": "update_weights_from_tensor",
          "/update_weights_from_distributed": "update_weights_from_distributed"}


class HopError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class SchedulerHop:
    """Test double for SGLang's HTTP route + tokenizer manager + scheduler hop, for one engine."""

    def __init__(self, manager, url: str = "http://engine-0"):
        self.manager, self.url = manager, url

    def post(self, path: str, body: dict) -> dict:
        req = build(protocol.ROUTE_STRUCTS[path], body)
        out = getattr(self.manager, ROUTES[path])(req)
        if not out.success:  # the routes answer 400 with the scheduler's message
            raise HopError(400, out.message)
        return {"success": True, "message": out.message}


@pytest.fixture(scope="module")
def tp_cpu_group():
    return join_group("127.0.0.1", free_port(), 0, 1, "conformance_tp_cpu_group", "gloo", timedelta(seconds=30))


@pytest.fixture
def engine(tp_cpu_group):
    io_struct()  # installs the import doubles
    from sglang.srt.managers.scheduler_components import weight_updater

    target, draft = RecordingRunner("target"), RecordingRunner("draft")
    parallel = types.SimpleNamespace(tp_rank=0, tp_group=types.SimpleNamespace(cpu_group=tp_cpu_group))
    versions = []
    with mock.patch.object(weight_updater, "get_parallel", return_value=parallel), \
            mock.patch("sglang.srt.managers.tp_worker.get_parallel", return_value=parallel):
        manager = weight_updater.SchedulerWeightUpdaterManager(
            tp_worker=StandInTpWorker(target, draft), draft_worker=None, memory_saver_adapter=None,
            flush_cache=lambda **_: True, is_fully_idle=lambda **_: True,
            scheduler=types.SimpleNamespace(
                record_weight_version_change=lambda new_version: versions.append(new_version)))
        manager.draft_worker = types.SimpleNamespace(weight_update_runners=lambda: [("draft", draft)])
        yield types.SimpleNamespace(hop=SchedulerHop(manager), target=target, draft=draft, versions=versions)


def bucket() -> Bucket:
    return Bucket("target", [NamedTensor("model.norm.weight", torch.full((8,), 3.0)),
                             NamedTensor("model.mtp.0.proj.weight", torch.arange(12.0).reshape(3, 4))])


@pytest.mark.parametrize("selector,loads", [("target", {"target"}), ("all", {"target", "draft"}),
                                             ("draft", {"draft"})])
def test_our_session_is_accepted_and_loads_the_selected_runners(engine, selector, loads):
    post_all([engine.hop], "/begin_weight_update", protocol.begin_payload(selector))
    TensorTransport([engine.hop]).send(bucket(), selector, "step-3")
    post_all([engine.hop], "/end_weight_update", protocol.end_payload())
    for runner in (engine.target, engine.draft):
        if runner.role in loads:
            assert runner.calls == ["begin", "load", "end"], runner.role
            assert torch.equal(runner.loaded["model.norm.weight"], torch.full((8,), 3.0))
        else:
            assert runner.calls == [], runner.role
    assert engine.versions == ["step-3"]


@pytest.mark.parametrize("route", ["/update_weights_from_tensor", "/update_weights_from_distributed"])
def test_an_update_outside_a_session_is_refused(engine, route):
    if route == "/update_weights_from_tensor":
        body = protocol.tensor_payload(serialize_for_tp_ranks([("w", torch.ones(2))], 1), selector="all",
                                       weight_version=None, flush_cache=False, session=True)
    else:
        body = protocol.distributed_payload(["w"], ["float32"], [[2]], group_name="wug", selector="all",
                                            weight_version=None, flush_cache=False, session=True)
    with pytest.raises(Exception) as err:
        post_all([engine.hop], route, body)
    assert "must run between begin_weight_update() and end_weight_update()" in str(err.value)
    assert engine.target.calls == [] and engine.draft.calls == []


def test_a_second_begin_and_an_end_without_begin_are_refused(engine):
    post_all([engine.hop], "/begin_weight_update", protocol.begin_payload("all"))
    with pytest.raises(Exception, match="already open"):
        post_all([engine.hop], "/begin_weight_update", protocol.begin_payload("all"))
    post_all([engine.hop], "/end_weight_update", protocol.end_payload())
    with pytest.raises(Exception, match="no weight-update session is open"):
        post_all([engine.hop], "/end_weight_update", protocol.end_payload())


def test_selector_defaults_to_all_on_begin_and_update():
    assert build("BeginWeightUpdateReqInput", {}).selector == "all"
    assert build("UpdateWeightsFromTensorReqInput", {"serialized_named_tensors": []}).selector == "all"
    assert build("UpdateWeightsFromDistributedReqInput", {"names": [], "dtypes": [], "shapes": []}).selector == "all"
