"""Ctrl-C, SIGTERM and SIGKILL of the driver mid-rollout leave no process of the run behind (issue #11).

Each test starts a run on a private Ray (`--debug-rollout-only`; SIGTERM: a training run, shared with
test_local_sockets.py), waits until a rollout request is in flight, signals the driver, and polls until no
process of the run (engine servers, gcs_server, raylet, agents, workers) is left. SIGINT and SIGTERM unwind
through the shutdown path, which must not restart the engines it just stopped; after SIGKILL the driver's reaper
(slime_spec/cluster/ray_reaper.py) and the engines' PR_SET_PDEATHSIG do it.
"""

import re
import signal

import pytest

from tests.e2e.run_processes import Run, Signalled, make_run_inputs, signal_mid_rollout


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    return root, *make_run_inputs(root)


def check_nothing_left(done: Signalled) -> None:
    assert any("slime_spec.engine" in c for c in done.cmdlines), done.cmdlines  # an engine was serving
    assert not done.left, f"{len(done.left)} process(es) of the run left {done.waited:.1f} s after " \
        f"{done.sig.name}:\n" + "\n".join(done.left) + "\n--- driver log ---\n" + done.output[-3000:]
    print(f"{done.sig.name}: every process of the run gone {done.waited:.1f} s after the driver exited")
    assert "was restarted" not in done.output, done.output[-3000:]
    if done.sig != signal.SIGKILL:  # the shutdown path stopped everything; the reaper had nothing left to stop
        assert done.returncode != 0 and "[ray_reaper]" not in done.output, \
            "the reaper stopped:\n" + "\n".join(reaped(done)) + "\n--- driver log ---\n" + done.output[-3000:]


def reaped(done: Signalled) -> list[str]:
    """What the reaper says it stopped, each pid as it was seen mid-rollout."""
    found = re.search(r"\[ray_reaper\].*stopped \d+ process\(es\) it left: \[([\d, ]*)\]", done.output)
    pids = [int(p) for p in found.group(1).split(",") if p.strip()] if found else []
    return [done.described.get(pid, f"{pid} (not a process of the run mid-rollout)") for pid in pids]


@pytest.mark.parametrize("sig", [
    # the reaper's part of a SIGKILL, per commit: tests/test_ray_reaper.py
    pytest.param(signal.SIGKILL, marks=pytest.mark.nightly(
        covered_by="tests/test_ray_reaper.py::test_descendants_of_a_killed_driver_are_stopped_and_nothing_else")),
    pytest.param(signal.SIGINT, marks=pytest.mark.nightly(
        covered_by="tests/e2e/test_driver_signals.py::test_sigterm_mid_rollout_of_a_training_run_leaves_nothing_behind"))],
    ids=lambda s: s.name)
def test_signal_mid_rollout_leaves_nothing_behind(inputs, sig):
    root, model, data = inputs
    check_nothing_left(signal_mid_rollout(Run(root, model, data, sig.name.lower()), sig))


def test_sigterm_mid_rollout_of_a_training_run_leaves_nothing_behind(sigterm_mid_training_run):
    check_nothing_left(sigterm_mid_training_run)
