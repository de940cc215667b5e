import signal

import pytest

from tests.e2e.run_processes import Run, make_run_inputs, signal_mid_rollout
from tests.helpers.ray_head import RayHead


@pytest.fixture(scope="package")
def ray_head():
    """One Ray head for the runs of tests/e2e that only need a cluster to join (tests/helpers/ray_head.py);
    stopped when the package's last test is done, so no other test finds it running."""
    head = RayHead().start()
    yield head
    head.stop()


@pytest.fixture(scope="package")
def sigterm_mid_training_run(tmp_path_factory):
    """A training run (trainer, weight-update group, one embedded engine) on a private Ray, SIGTERMed mid-rollout:
    its sockets are checked by test_local_sockets.py, its unwinding by test_driver_signals.py."""
    root = tmp_path_factory.mktemp("sigterm_training")
    model, data = make_run_inputs(root)
    return signal_mid_rollout(Run(root, model, data, "sigterm", train=True), signal.SIGTERM)
