"""Ctrl-C, SIGTERM and SIGKILL of the driver mid-rollout leave no process of the run behind (issue #11).

Each test starts a `--debug-rollout-only` run of an embedded engine on a private Ray, waits until a rollout
request is in flight, signals the driver, and polls until no process of the run (engine servers, gcs_server,
raylet, agents, workers) is left. SIGINT and SIGTERM unwind through the shutdown path, which must not
restart the engines it just stopped; after SIGKILL the driver's reaper (slime_spec/cluster/ray_reaper.py) and the
engines' PR_SET_PDEATHSIG do it.
"""

import signal

import pytest

from tests.e2e.run_processes import Run, make_run_inputs, wait_gone

GONE_WITHIN_S = 15.0  # after the driver exits, every process of the run is gone within this
# a graceful unwind (engines, Ray) takes a few seconds; a generous bound for a loaded 2-core machine
DRIVER_EXIT_S = 60.0


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    return root, *make_run_inputs(root)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_signal_mid_rollout_leaves_nothing_behind(inputs, sig):
    root, model, data = inputs
    run = Run(root, model, data, sig.name.lower())
    try:
        run.wait_mid_rollout()
        assert any("slime_spec.engine" in " ".join(p.cmdline()) for p in run.processes())
        run.proc.send_signal(sig)
        run.proc.wait(DRIVER_EXIT_S)
        left, waited = wait_gone(run.tag, GONE_WITHIN_S)
        assert not left, f"{len(left)} process(es) of the run left {waited:.1f} s after {sig.name}:\n" + \
            "\n".join(left) + "\n--- driver log ---\n" + run.output()[-3000:]
        print(f"{sig.name}: every process of the run gone {waited:.1f} s after the driver exited")
        assert "was restarted" not in run.output(), run.output()[-3000:]
        if sig != signal.SIGKILL:  # the shutdown path stopped everything; the reaper had nothing left to stop
            assert run.proc.returncode != 0 and "[ray_reaper]" not in run.output(), run.output()[-3000:]
    finally:
        run.stop()
