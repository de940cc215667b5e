"""Helpers for the e2e tests that start `python -m slime_spec.train` and inspect the processes it starts.

Every process of a run is recognised by an environment variable only that run carries (`RUN_MARKER`): the
driver gets it, and Ray's gcs_server, raylet, agents and workers and the engine servers inherit it. Nothing
else on the machine is ever looked at twice or touched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from slime_spec.tools.tiny_model import make_tiny_model

RUN_MARKER = "SLIME_SPEC_E2E_RUN"
REPO = Path(__file__).resolve().parents[2]

# Marks that a rollout request is in flight, and slows each request a little so the rollout lasts.
HOOK = """
import asyncio
from pathlib import Path
from slime_spec.rollout.generate import default_generate
IN_FLIGHT = Path({in_flight!r})
async def generate_slowly(client, sample, sampling_params):
    IN_FLIGHT.touch()
    await asyncio.sleep(0.2)
    return await default_generate(client, sample, sampling_params)
"""


def make_run_inputs(root: Path) -> tuple[Path, Path]:
    """A tiny llama checkpoint and a prompt file."""
    model = make_tiny_model(root / "model", arch="llama", hidden_size=32, num_layers=1, intermediate_size=64,
                            max_position_embeddings=256, seed=5)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(16)))
    return model, data


def _default_sigint() -> None:
    """The driver gets SIGINT's default disposition, as a terminal's Ctrl-C finds it. A suite started in the
    background of a non-interactive shell (`make test &`) runs with SIGINT ignored, which a child inherits, and
    Python installs no KeyboardInterrupt handler for an ignored SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """A run of one embedded engine with many rollouts, started in the background: `--debug-rollout-only`,
    or with `train` the whole loop (trainer, weight-update group) as well."""

    def __init__(self, root: Path, model: Path, data: Path, name: str, train: bool = False):
        self.dir = root / name
        self.dir.mkdir()
        self.tag = f"{name}-{uuid.uuid4().hex[:8]}"
        self.in_flight = self.dir / "in_flight"
        (self.dir / "run_hook.py").write_text(textwrap.dedent(HOOK.format(in_flight=str(self.in_flight))))
        self.log = self.dir / "driver.log"
        argv = [sys.executable, "-m", "slime_spec.train", "--hf-checkpoint", str(model),
                "--rollout-backend", "embedded", "--rollout-num-engines", "1",
                "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
                "--rm-type", "exact_match", "--num-rollout", "1000", "--rollout-batch-size", "4",
                "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
                "--custom-generate-function-path", "run_hook.generate_slowly", "--output-dir", str(self.dir / "out")]
        argv += ["--global-batch-size", "8", "--micro-batch-size", "4"] if train else ["--debug-rollout-only"]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update({RUN_MARKER: self.tag, "PYTHONPATH": os.pathsep.join([str(REPO), str(self.dir)])})
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.dir, preexec_fn=_default_sigint)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_mid_rollout(self, timeout_s: float = 180.0) -> None:
        """Until a rollout request is in flight (the engines are up and serving)."""
        deadline = time.monotonic() + timeout_s
        while not self.in_flight.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"the run exited ({self.proc.returncode}) before its rollout:\n"
                                     + self.output()[-3000:])
            if time.monotonic() > deadline:
                raise AssertionError(f"no rollout request after {timeout_s:.0f} s:\n" + self.output()[-3000:])
            time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        """Every live (not zombie) process carrying this run's marker."""
        return processes_marked(self.tag)

    def stop(self) -> None:
        """Test clean-up: SIGKILL whatever of this run is still alive."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in self.processes():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


@dataclass
class Signalled:
    """What `signal_mid_rollout` saw: the run's processes and listening sockets mid-rollout, then after the signal."""

    sig: signal.Signals
    names: str  # every process of the run mid-rollout, by name
    cmdlines: list[str]
    described: dict[int, str]  # pid -> `describe` of every process of the run mid-rollout
    sockets: list[tuple[str, str, int]]  # (process, ip, port) of every listening TCP socket mid-rollout
    returncode: int
    left: list[str]  # processes of the run still alive GONE_WITHIN_S after the driver exited
    waited: float
    output: str


GONE_WITHIN_S = 15.0  # after the driver exits, every process of the run is gone within this
# a graceful unwind (engines, Ray) takes a few seconds; a generous bound for a loaded 2-core machine
DRIVER_EXIT_S = 60.0


def signal_mid_rollout(run: Run, sig: signal.Signals) -> Signalled:
    """Wait until `run` has a rollout request in flight, note its processes and sockets, send the driver `sig`,
    and poll until no process of the run is left (or GONE_WITHIN_S passed); SIGKILLs what is left either way."""
    try:
        run.wait_mid_rollout()
        procs = run.processes()
        names, cmdlines, sockets = " ".join(p.name() for p in procs), [], listening(procs)
        described = {p.pid: describe(p) for p in procs}
        for p in procs:
            try:
                cmdlines.append(" ".join(p.cmdline()))
            except psutil.NoSuchProcess:
                continue
        run.proc.send_signal(sig)
        run.proc.wait(DRIVER_EXIT_S)
        left, waited = wait_gone(run.tag, GONE_WITHIN_S)
        return Signalled(sig, names, cmdlines, described, sockets, run.proc.returncode, left, waited, run.output())
    finally:
        run.stop()


def listening(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    out = []
    for p in procs:
        try:
            out += [(describe(p), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return out


def processes_marked(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(RUN_MARKER) == tag:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.name()} {' '.join(p.cmdline())[:160]}"
    except psutil.Error:
        return f"{p.pid} (gone)"


def wait_gone(tag: str, timeout_s: float) -> tuple[list[str], float]:
    """Poll until no process of the run is left; (those left at the deadline, seconds waited)."""
    start = time.monotonic()
    while True:
        left = processes_marked(tag)
        waited = time.monotonic() - start
        if not left or waited > timeout_s:
            return [describe(p) for p in left], waited
        time.sleep(0.25)
