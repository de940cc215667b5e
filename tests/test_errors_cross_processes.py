"""The errors that leave a Ray actor arrive whole: pickled as Ray sends them, each comes back with its type, message
and fields, and Ray's wrapper of a task's error still reads them through (the driver restarts the engines a failed
sync left stuck from `WeightSyncError.stuck_urls`)."""

import pickle
from pathlib import Path

import pytest
import ray.cloudpickle
from ray.exceptions import RayTaskError

from slime_spec.fleet.client import EngineError, EngineGroupError
from slime_spec.fleet.process import EngineStartError
from slime_spec.weight_sync.errors import WeightSyncError
from slime_spec.weight_sync.transports.http_transports import BroadcastStuck
from slime_spec.weight_sync.verify.served_state import EngineVerdict

URL = "http://127.0.0.1:30000"
ERRORS = {
    "engine": EngineError(URL, "/generate", 503, "busy"),
    "unreachable": EngineError(URL, "/generate", None, "connection refused"),
    "group": EngineGroupError("/update_weights_from_distributed", {URL: EngineError(URL, "/x", 500, "boom")}, ["u2"]),
    "start": EngineStartError("exited before it was ready", argv=["python", "-m", "slime_spec.engine"], exit_code=1,
                              log_path=Path("/tmp/engine_0.log"), log_tail="Traceback ..."),
    "stuck": BroadcastStuck([URL], "the broadcast failed"),
    "sync": WeightSyncError("the sync of '3' failed", False,
                            [EngineVerdict(URL, "previous", "2", agree=5, total=5)], stuck_urls=[URL]),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_each_error_survives_pickling_with_its_fields(name):
    error = ERRORS[name]
    for dumps, loads in ((pickle.dumps, pickle.loads), (ray.cloudpickle.dumps, ray.cloudpickle.loads)):
        back = loads(dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert back.__dict__.keys() == error.__dict__.keys()
    if name == "unreachable":
        assert back.unreachable
    if name == "group":
        assert isinstance(back.failures[URL], EngineError) and back.failures[URL].status == 500
    if name == "sync":
        assert back.engines == error.engines and back.metrics() == error.metrics()


def test_a_failed_sync_reaches_the_driver_through_rays_wrapper_with_its_stuck_engines():
    try:
        raise ERRORS["sync"]
    except WeightSyncError as e:
        wrapped = RayTaskError("TrainActor.sync_weights", "Traceback ...", e)
    back = ray.cloudpickle.loads(ray.cloudpickle.dumps(wrapped)).as_instanceof_cause()
    assert isinstance(back, WeightSyncError)  # what `except WeightSyncError` in the driver matches
    assert back.stuck_urls == [URL] and not back.engines_serve_previous_weights
