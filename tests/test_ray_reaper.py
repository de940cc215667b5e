"""cluster/ray_reaper.py: when the driver dies without cleaning up, its descendants are stopped; nothing else is."""

import subprocess
import sys

import psutil
import pytest

from slime_spec.cluster.ray_reaper import start_reaper

# A "driver" that starts a grandchild in a session of its own (as Ray and the engine launcher do), prints
# the grandchild's pid and then waits to be killed.
DRIVER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_descendants_of_a_killed_driver_are_stopped_and_nothing_else():
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    reaper = None
    try:
        grandchild = int(driver.stdout.readline())
        reaper = start_reaper(driver.pid)  # returns once the reaper has listed the driver's descendants
        driver.kill()
        driver.wait()
        assert _alive(grandchild)  # orphaned, as Ray's processes are after a SIGKILLed driver
        reaper.wait(timeout=30)
        assert not _alive(grandchild)
        assert bystander.poll() is None
    finally:
        for p in (bystander, driver):
            p.kill()
        if reaper is not None and reaper.poll() is None:
            reaper.kill()


def test_a_reaper_for_a_driver_already_gone_says_so_and_stops_nothing():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(RuntimeError, match="did not start watching.*exit code 1"):
        start_reaper(gone.pid)
