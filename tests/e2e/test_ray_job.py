"""A real cluster path on CPU: scripts/run-mimo-7B-rl-mtp.sh, as a user runs it on a small machine.

The script starts its own `ray start --head` (loopback, every service on a port it chose free, its own temp
dir, Ray 2.60 token authentication with a token this test writes), submits `python -m slime_spec.train` with
`ray job submit`, and the job runs two GRPO steps on a tiny MiMo: speculative rollout (NEXTN) on the embedded
engine, online MTP training, a weight sync per step and a held-out eval. The only changes to the
script are the documented environment overrides. Beside it "another Ray cluster" holds Ray's default ports
(GCS, dashboard, dashboard agent, client server: listeners this test opens, or whoever holds them already):
the script neither submits to it nor collides with it. Afterwards the head's process group is gone.
"""

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from slime_spec.tools.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "run-mimo-7B-rl-mtp.sh"


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def group_alive(pgid: int) -> bool:
    """A live (not zombie) process in the group: zombies of a killed head wait for init to reap them."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # after "comm)": state, ppid, pgrp
            return True
    return False


# Ray 2.60's defaults: GCS, dashboard (job server), dashboard agent, Ray client server.
RAY_DEFAULT_PORTS = (6379, 8265, 52365, 10001)


def lineage(pid: int) -> set[int]:
    """`pid`, its ancestors, and the session ids of them all (a job's driver runs in a session of its own under
    the head's raylet)."""
    ids = set()
    while pid > 1 and pid not in ids:
        ids.add(pid)
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            break
        ids.add(int(fields[3]))  # after "comm)": state, ppid, pgrp, session
        pid = int(fields[1])
    return ids


def socket_owner(peer: tuple[str, int]) -> tuple[int, set[int], str] | None:
    """(pid, its lineage, command line) of the process whose TCP socket has local address `peer`; None when
    that socket is gone (the client closed it) or no process holds it."""
    local = f"{socket.inet_aton(peer[0])[::-1].hex().upper()}:{peer[1]:04X}"  # /proc/net/tcp's little-endian form
    inode = next((fields[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                  if (fields := line.split())[1] == local and fields[9] != "0"), None)
    if inode is None:
        return None
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if not any(os.readlink(fd) == f"socket:[{inode}]" for fd in fd_dir.iterdir()):
                continue
            pid = int(fd_dir.parent.name)
            cmdline = (fd_dir.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        return pid, lineage(pid), cmdline.strip()
    return None


class OtherCluster:
    """Listens on each of `ports` that is free (one already taken stands for another cluster all the same) and
    records, for each connection it accepts, the port and the connecting process (pid, lineage, command line;
    None when the client was gone before it could be looked up): a script that submits or probes there shows
    up here. Other tests running beside this one (their own Ray clusters) may connect too; the lineage tells
    theirs from the script's."""

    def __init__(self, ports):
        self.socks, self.accepted = [], []
        for port in ports:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen()
            s.settimeout(0.2)
            self.socks.append(s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while not self._stop.is_set():
            for s in self.socks:
                try:
                    conn, peer = s.accept()
                except OSError:
                    continue
                self.accepted.append((s.getsockname()[1], socket_owner(peer)))
                conn.close()

    def from_processes(self, roots: set[int]) -> list:
        """Accepted connections whose client descends from, or ran in the session of, one of `roots`."""
        return [(port, owner) for port, owner in self.accepted if owner is not None and owner[1] & roots]

    def close(self):
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()


@pytest.fixture
def other_cluster():
    other = OtherCluster(RAY_DEFAULT_PORTS)
    yield other
    other.close()


def head_ports(out: str) -> tuple[int, int]:
    """The GCS and job server ports of the head the script says it started."""
    m = re.search(r"starting a head node at [\d.]+:(\d+), jobs to http://[\d.]+:(\d+)", out)
    assert m, "the script did not say which head it started:\n" + out[-3000:]
    return int(m.group(1)), int(m.group(2))


@pytest.fixture
def workdir(tmp_path):
    missing = [m for m in ("aiohttp_cors", "opencensus", "prometheus_client") if importlib.util.find_spec(m) is None]
    assert not missing, (f"Ray's job server needs ray[default] (missing {missing}): "
                         f"pip install 'ray[default]==2.60.0' (requirements.txt)")
    # Ray's unix sockets live under the temp dir and must stay under ~107 characters: a short path.
    ray_tmp = Path(tempfile.mkdtemp(prefix="ssray", dir="/tmp"))
    yield tmp_path, ray_tmp
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_script_job_two_grpo_steps_on_a_head_it_started_beside_another_cluster(workdir, other_cluster):
    tmp, ray_tmp = workdir
    model = make_tiny_model(tmp / "model", arch="mimo", mtp_layers=1, hidden_size=32, num_layers=1,
                            intermediate_size=64, max_position_embeddings=128, seed=3)
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(12)))
    token = tmp / "ray_auth_token"
    token.write_text(uuid.uuid4().hex)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "WANDB_")) and k not in ("DEBUG_ROLLOUT_ONLY", "DOCTOR_ONLY", "EXTRA_ARGS")}
    env.update(
        PYTHON=sys.executable, SMALL_MACHINE="1", HF_CHECKPOINT=str(model), PROMPT_DATA=str(data),
        EVAL_PROMPT_DATA=str(data), BASE_DIR=str(tmp), CKPT_DIR=str(tmp / "ckpt"), OUTPUT_DIR=str(tmp / "out"),
        MASTER_ADDR="127.0.0.1", RAY_TEMP_DIR=str(ray_tmp), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
        # the tiny model: its vocabulary has no math answers, exact_match keeps the reward defined
        EXTRA_ARGS="--sglang-speculative-algorithm NEXTN --sglang-speculative-num-steps 2 "
                   "--sglang-speculative-num-draft-tokens 3 --rm-type exact_match --rollout-skip-special-tokens "
                   "--eval-interval 1",
    )
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the script's trap stops its job and its head
        out, _ = proc.communicate(timeout=60)
        pytest.fail("the script did not finish in 420 s:\n" + out[-6000:])
    head = re.search(r"stopping the Ray head this script started \(process group (\d+)\)", out)
    try:
        assert proc.returncode == 0, out[-6000:]
        assert "(RAY_AUTH_MODE=token" in out
        gcs, dashboard = head_ports(out)
        assert not {gcs, dashboard} & set(RAY_DEFAULT_PORTS)
        # nothing was submitted to, or asked of, the other cluster by the script or the head it started (setsid:
        # a session of its own)
        assert other_cluster.from_processes({proc.pid, int(head.group(1))}) == [], other_cluster.accepted
        assert re.search(r"Job 'run-mimo-7B-rl-mtp-[\w-]+' succeeded", out), out[-3000:]
        assert "Failed to merge the Job's runtime env" not in out
        assert "collapsed" not in out  # a fresh MTP layer is an untrained draft, not a collapse
        job_out = out.split("Running entrypoint for job", 1)[1]  # the driver's and the workers' output
        for noise in ("Apex is not installed", "Apex are not installed", "to instantiate a model of type ``.",
                      "full scope is deprecated"):
            assert noise not in job_out, noise

        steps = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
        assert [s["rollout_id"] for s in steps] == [0, 1]
        for s in steps:
            assert s["num_samples"] == 4 and s["spec_verify_ct"] > 0 and s["spec_accept_length"] >= 1.0
            assert s["mtp_loss"] > 0 and "loss" in s  # online MTP training ran
            assert s["weight_sync_params"] > 0 and s["weight_sync_mtp_params"] > 0  # target and MTP synced
            assert s["eval/eval/num_samples"] == 12
        for i in range(2):
            assert re.search(rf"rollout {i}\b.*\b4 samples", out)  # the job's own log lines reached the submitter
        assert (tmp / "out" / "plot.png").stat().st_size > 1000
        assert (tmp / "ckpt" / "iter_0000001").is_dir()  # the last step is saved
    finally:
        assert head, "the script did not start (or did not report) a Ray head:\n" + out[-3000:]
        pgid = int(head.group(1))
        if group_alive(pgid):  # the script should have stopped it: never leave a head behind
            os.killpg(pgid, signal.SIGKILL)
            pytest.fail(f"the Ray head's process group {pgid} outlived the script")
    assert not port_open(gcs) and not port_open(dashboard)
