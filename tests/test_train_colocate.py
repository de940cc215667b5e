"""A colocated step's hand-over on GPUs (slime_spec/driver/loop.py `_steps`): the trainer is offloaded while the engines
generate and onloaded only after they released their memory; after training, in slime's order, the trainer is
offloaded, the engines resume their weights, the sync runs (liveness by ping, the canary deferred), then the engines
resume their CUDA graphs and KV cache and the canary reads them; each move is timed, and the peak memory per GPU is
in the step's metrics.

The trainer group, the rollout manager, the step report and the GPU memory monitor are test doubles (no Ray cluster
or GPU here) answering the calls `_steps` makes of TrainGroup, RolloutManager, LoopReport and GpuMemoryMonitor."""

import contextlib

import pytest
import ray

from slime_spec.config.args import parse_config
from slime_spec.driver import loop as train
from slime_spec.tools.tiny_model import make_tiny_model


class _Call:
    def __init__(self, log, name, result=None):
        self.log, self.name, self.result = log, name, result

    def remote(self, *args):
        separator = "" if self.name.endswith("=") else " "
        self.log.append(self.name if not args or self.name == "rollout" else f"{self.name}{separator}{args[0]}")
        return self.result(*args) if callable(self.result) else self.result


class _Manager:
    """RolloutManager double: one engine, always alive, serving whatever version it is confirmed."""

    def __init__(self, log):
        self.engine_urls = _Call([], "engine_urls", ["http://e0"])
        self.check_engines = _Call(log, "liveness, generate=", lambda generate: [])
        self.engines_needing_sync = _Call([], "needing", [])
        self.confirm_weights = _Call([], "confirm", [])
        self.generate = _Call(log, "rollout", lambda rollout_id: ["sample"])
        self.get_last_metrics = _Call([], "metrics", {"rollout_time_s": 1.0})
        self.release_memory = _Call(log, "engine release", None)
        self.data_position = _Call([], "position", {})
        self.resume_memory = _Call(log, "engine resume", None)


class _Trainer:
    """TrainGroup double on GPUs: records the order of its calls."""

    uses_gpu = True

    def __init__(self, log):
        self.log = log

    def connect_engines(self, urls):
        pass

    def offload(self):
        self.log.append("trainer offload")
        return {"trainer_offload_s": 0.5, "trainer_offload_gib": 2.0}

    def onload(self):
        self.log.append("trainer onload")
        return {"trainer_onload_s": 0.25}

    def train_step(self, samples, rollout_id):
        self.log.append("train")
        return {"loss": 0.0}

    def sync_weights(self, version, probe_samples=None, restarted_urls=None, defer_canary=False):
        assert not (defer_canary and probe_samples), "a deferred canary got its probe from canary_before"
        self.log.append("sync, canary deferred" if defer_canary else "sync")
        return {"weight_sync_params": 1}

    def canary_before(self, probe_samples):
        self.log.append("canary before")

    def canary_after(self):
        self.log.append("canary after")
        return {"spec_canary_accept_length": 2.0}

    def save(self, rollout_id, data_position):
        self.log.append("save")


class _Report:
    def __init__(self):
        self.steps = []

    def add(self, step):
        self.steps.append(step)

    def finish(self):
        return {"rollouts": self.steps}


class _Memory:
    def __init__(self, log):
        self.log = log

    @contextlib.contextmanager
    def window(self, name):
        self.log.append(f"memory window {name}")
        yield
        self.log.append(f"memory window {name} closed")

    def take_peaks(self):
        return {"gpu0_peak_memory_gib": 7.5, "gpu0_sync_peak_memory_gib": 2.5}


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr(ray, "get", lambda value, **kw: value)
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: (refs, []))


def _config(tmp_path, *flags):
    model = make_tiny_model(tmp_path / "m", arch="mimo", mtp_layers=1, num_layers=1)
    config, _ = parse_config(["--hf-checkpoint", str(model), "--rollout-backend", "embedded", "--num-rollout", "2",
                              "--rollout-num-gpus", "1", "--output-dir", str(tmp_path / "run"), *flags])
    return config


def test_colocated_steps_offload_the_trainer_while_engines_generate_and_time_every_move(tmp_path):
    log = []
    manager = _Manager(log)
    out = train._steps(_config(tmp_path, "--colocate", "--save", str(tmp_path / "ckpt")), _Trainer(log), manager,
                       _Report(), 0, None, _Memory(log))
    step = ["liveness, generate=True", "rollout", "canary before", "engine release", "trainer onload", "train", "save?",
            "trainer offload",
            "engine resume ['weights']", "memory window sync", "liveness, generate=False",
            "sync, canary deferred", "memory window sync closed", "engine resume ['cuda_graph', 'kv_cache']",
            "canary after"]
    first, last = [s for s in step if s != "save?"], [s.rstrip("?") for s in step]
    assert log == ["trainer offload", *first, *last]  # the last step saves: before the offload, on the GPU
    for metrics in out["rollouts"]:
        assert metrics["trainer_offload_s"] == 0.5 and metrics["trainer_onload_s"] == 0.25
        assert {"engine_release_s", "engine_resume_s", "train_time_s", "sync_time_s"} <= set(metrics)
        assert metrics["gpu0_peak_memory_gib"] == 7.5 and metrics["gpu0_sync_peak_memory_gib"] == 2.5
        assert metrics["spec_canary_accept_length"] == 2.0


def test_split_steps_move_nothing(tmp_path):
    log = []
    out = train._steps(_config(tmp_path), _Trainer(log), _Manager(log), _Report(), 0, None, None)
    assert log == ["liveness, generate=True", "rollout", "train", "liveness, generate=True", "sync"] * 2
    assert not any(k.startswith(("trainer_", "engine_", "gpu")) for m in out["rollouts"] for k in m)
