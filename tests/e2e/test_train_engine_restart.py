"""An engine killed mid-rollout in a TRAINING run: the run finishes every step and trains only on samples of
the current weights (issue #11's first "done when").

`python -m slime_spec.train`, separate placement, two embedded engines, three steps. A generate hook (a test
double for a crash) SIGKILLs the engine server serving the second request of rollout 1, after the first weight
sync: the restarted server loads --hf-checkpoint, the fleet fences it, the driver has the trainer re-sync it,
and every sample of every rollout records the version the policy was at. The saved rollout data is checked.
"""

import json
import os
import subprocess
import sys
import textwrap

from slime_spec.rollout.debug_data import load_rollout
from slime_spec.rollout.sample import Status
from tests.e2e.run_processes import REPO, make_run_inputs

STEPS, BATCH, N = 3, 2, 2

# Kills, once, the engine server of the second request of rollout 1 (request BATCH * N + 2 of the run).
HOOK = """
import os, signal
from urllib.parse import urlparse
import psutil
from slime_spec.rollout.generate import default_generate
calls = 0
KILLED = {killed!r}
async def generate_killing_engine(client, sample, sampling_params):
    global calls
    calls += 1
    if calls == {kill_at} and not os.path.exists(KILLED):
        port = urlparse(client.url).port
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
                open(KILLED, "w").write(str(c.pid))
                os.kill(c.pid, signal.SIGKILL)
    return await default_generate(client, sample, sampling_params)
"""


def test_engine_killed_mid_rollout_of_a_training_run(tmp_path):
    model, data = make_run_inputs(tmp_path)
    killed = tmp_path / "killed_pid"
    (tmp_path / "train_hook.py").write_text(textwrap.dedent(HOOK.format(killed=str(killed), kill_at=BATCH * N + 2)))
    saved = str(tmp_path / "rollouts" / "rollout_{rollout_id}.pt")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "slime_spec.train", "--hf-checkpoint", str(model), "--rollout-backend", "embedded",
            "--rollout-num-engines", "2", "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
            "--rm-type", "exact_match", "--num-rollout", str(STEPS), "--rollout-batch-size", str(BATCH),
            "--n-samples-per-prompt", str(N), "--rollout-max-response-len", "4", "--global-batch-size", str(BATCH * N),
            "--micro-batch-size", "2", "--lr", "1e-3", "--save-debug-rollout-data", saved,
            "--custom-generate-function-path", "train_hook.generate_killing_engine", "--output-dir", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tmp_path)])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=420, env=env, cwd=tmp_path)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert killed.exists(), "the hook never killed an engine:\n" + log

    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in steps] == list(range(STEPS)), log
    assert [m["engine_restarts"] for m in steps] == [0, 1, 0], log
    assert steps[1]["resync/weight_sync_params"] > 0  # the restarted engine got the policy before serving
    assert all(m["stale_samples"] == 0 and "loss" in m for m in steps)
    # every trained sample was generated with the weights the policy had when the rollout ran
    expected = ["default", "0", "1"]  # the engines' start-up version, then the version each sync pushed
    for rollout_id, version in enumerate(expected):
        samples = load_rollout(saved, rollout_id)
        assert len(samples) == BATCH * N
        assert all(s.status != Status.ABORTED for s in samples), [s.error for s in samples]
        assert [s.weight_version for s in samples] == [version] * len(samples), \
            [(s.engine_index, s.weight_version) for s in samples]
