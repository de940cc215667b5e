"""cluster/private_ray.py: a driver's private Ray is stopped with every process of it (workers, and what they
started) gone before `stop()` returns; a process that outlives the wait is returned, not waited on for ever."""

import json
import os
import subprocess
import sys
import time

import psutil

from slime_spec.cluster.private_ray import _wait_gone
from tests.e2e.run_processes import REPO

# A driver: a private Ray, two actors (one starts a child, as an engine actor starts its server), then `stop()`.
# Prints the actors' and the child's pids, those `stop()` waits on, what it returned and what was alive after it.
DRIVER = """
import json, os, subprocess, sys, psutil, ray
from slime_spec.cluster import private_ray
private_ray.start()

@ray.remote
class Worker:
    def pid(self):
        return os.getpid()
    def start_child(self):
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True).pid

workers = [Worker.remote() for _ in range(2)]
pids = ray.get([w.pid.remote() for w in workers])
child = ray.get(workers[0].start_child.remote())
watched = list(private_ray._processes_of_ray(private_ray._reaper.pid))
reaper = private_ray._reaper.pid
left = private_ray.stop()
alive = [pid for pid in pids + [child] if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
print(json.dumps({"ours": pids + [child], "watched": watched, "reaper": reaper, "left": left, "alive": alive,
                  "running": private_ray.running()}), flush=True)
"""


def test_stop_returns_once_every_worker_and_its_child_is_gone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(out["ours"]) <= set(out["watched"]) and out["reaper"] not in out["watched"], out
    assert out["left"] == [] and out["alive"] == [] and out["running"] is False, out  # gone when stop() returned


def test_a_zombie_counts_as_gone_and_a_live_process_is_returned():
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # never waited on: a zombie once it exits
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        left = _wait_gone({p.pid: psutil.Process(p.pid).create_time() for p in (zombie, sleeper)}, wait_s=0.5)
        assert [p.pid for p in left] == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()
        zombie.wait()
