"""Fault injection for e2e runs: kill (SIGKILL) or hang (SIGSTOP) an engine server at a chosen phase of a
`python -m slime_spec.train` run. A test double for a crash or a hang; nothing in the product knows of it.

The run's processes (driver, Ray workers: rollout manager, trainer) start with a directory written by
`write_sitecustomize` on PYTHONPATH; its sitecustomize installs an import hook, in every process whose
environment has FAULT_PLAN_ENV, that wraps the one function where each phase happens:
- mid_rollout / mid_eval: `--custom-generate-function-path tests.helpers.engine_faults.generate` (manager)
- after_rollout (between the rollout and the sync) and hang: the driver's `TrainGroup.train_step` called with the
  rollout's samples, before anything goes to the trainer (driver)
- mid_train: `TrainGroup.train_step` submitted to the trainer, not yet finished (driver)
- mid_sync: the first bucket's `send` of the sync of the planned version (`WeightSyncer.sync_report`'s
  weight_version), the group formed and the session open (trainer rank 0)
Each fault fires once; it appends one JSON line (phase, engine, pid, signal) to `FAULT_LOG_ENV`'s file.
Engine i is found by its port in the run's engine_commands.txt (a restart keeps the port).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import signal
import sys
import time
from pathlib import Path

FAULT_PLAN_ENV = "SLIME_SPEC_TEST_FAULT_PLAN"  # JSON: {"phase": {"rollout_id": int, "engine": int, ...}}
FAULT_LOG_ENV = "SLIME_SPEC_TEST_FAULT_LOG"
COMMANDS_ENV = "SLIME_SPEC_TEST_ENGINE_COMMANDS"  # the run's engine_commands.txt
EVAL_MARK = "eval "  # eval prompts start with it, rollout prompts do not

SITECUSTOMIZE = """
import os
if os.environ.get({env!r}):
    from tests.helpers import engine_faults
    engine_faults.install()
"""


def write_sitecustomize(site_dir: Path) -> Path:
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE.format(env=FAULT_PLAN_ENV))
    return site_dir


def plan() -> dict:
    return json.loads(os.environ.get(FAULT_PLAN_ENV) or "{}")


def fired(phase: str) -> bool:
    path = os.environ.get(FAULT_LOG_ENV)
    return bool(path) and Path(path).exists() and any(
        json.loads(line)["phase"] == phase for line in Path(path).read_text().splitlines())


def engine_port(index: int) -> int:
    line = Path(os.environ[COMMANDS_ENV]).read_text().splitlines()[index]
    argv = line.split()
    return int(argv[argv.index("--port") + 1])


def server_pid(port: int) -> int:
    import psutil

    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            return c.pid
    raise RuntimeError(f"no process listens on port {port}")


def strike(phase: str, engine: int | None = None, port: int | None = None) -> None:
    """Fire `phase` once: SIGKILL the engine's server (SIGSTOP its whole process group for `hang`)."""
    if fired(phase):
        return
    pid = server_pid(port if port is not None else engine_port(engine))
    sig = signal.SIGSTOP if phase == "hang" else signal.SIGKILL
    record = {"phase": phase, "engine": engine, "port": port, "pid": pid, "signal": sig.name, "time": time.time()}
    with open(os.environ[FAULT_LOG_ENV], "a") as f:
        f.write(json.dumps(record) + "\n")
    if sig == signal.SIGSTOP:
        os.killpg(os.getpgid(pid), sig)
    else:
        os.kill(pid, sig)
    print(f"[engine_faults] {phase}: {sig.name} engine server pid {pid}", file=sys.stderr, flush=True)


# ---- mid_rollout, mid_eval: the rollout's generate function ----
_eval_calls = 0


async def generate(client, sample, sampling_params):
    from urllib.parse import urlparse

    from slime_spec.rollout.generate import default_generate
    global _eval_calls
    p = plan()
    port = urlparse(client.url).port
    if str(sample.prompt).startswith(EVAL_MARK):
        _eval_calls += 1
        at = p.get("mid_eval")
        if at and _eval_calls == at["eval_call"]:
            strike("mid_eval", port=port)
    else:
        at = p.get("mid_rollout")
        if at and sample.metadata.get("rollout_id") == at["rollout_id"] and sample.index == at["sample_index"]:
            strike("mid_rollout", port=port)
    return await default_generate(client, sample, sampling_params)


# ---- the wrapped functions ----
def _patch_train_group(module) -> None:
    original = module.TrainGroup.train_step

    def train_step(self, samples, rollout_id: int):
        for phase in ("after_rollout", "hang"):  # the rollout's samples are in; the trainer has not started
            at = plan().get(phase)
            if at and at["rollout_id"] == rollout_id:
                strike(phase, engine=at["engine"])
        at = plan().get("mid_train")
        if not at or at["rollout_id"] != rollout_id:
            return original(self, samples, rollout_id)
        import ray

        refs = [a.train_step.remote(samples, rollout_id) for a in self.actors]
        strike("mid_train", engine=at["engine"])
        return ray.get(refs)[0]

    module.TrainGroup.train_step = train_step


def _patch_syncer(module) -> None:
    """mid_sync keys on the sync's own version (the argument of `WeightSyncer.sync_report`; only the last bucket
    carries it): that sync's transport kills the engine as its first bucket is about to go out."""
    original = module.WeightSyncer.sync_report

    def sync_report(self, tensors, weight_version=None):
        at = plan().get("mid_sync")
        if not at or weight_version != str(at["rollout_id"]) or fired("mid_sync"):
            return original(self, tensors, weight_version)
        self.prepare()  # idempotent: the transport exists from here on
        transport = self.transport
        post = transport.post

        def post_striking(*args, **kwargs):
            strike("mid_sync", engine=at["engine"])
            return post(*args, **kwargs)

        transport.post = post_striking
        try:
            return original(self, tensors, weight_version)
        finally:
            if transport.__dict__.get("post") is post_striking:
                del transport.post

    module.WeightSyncer.sync_report = sync_report


PATCHES = {"slime_spec.trainer.group": _patch_train_group,
           "slime_spec.weight_sync.sync": _patch_syncer}


class _PatchAfterImport:
    """A meta path finder: the modules in PATCHES load as usual, then get their wrapper."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_then_patch
        return spec


def install() -> None:
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
