"""The driver's liveness around a sync (slime_spec/driver/loop.py): an engine lost during a sync is restarted and the
sync runs again in full, the restarted engine rejoining; a failure with every engine alive is raised as it is.

The rollout manager is a test double (a Ray actor cannot run here without a cluster) answering the same calls
as `RolloutManager`: check_engines, engines_needing_sync, engine_urls, confirm_weights."""

import threading

import pytest
import ray

from slime_spec.driver import loop as train


class _Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _Manager:
    """Engine 1 dies when `kill` is set; the next liveness check restarts it, fenced until a sync confirms it."""

    def __init__(self):
        self.urls, self.fenced, self.dead, self.version = ["http://e0", "http://e1"], set(), set(), "0"
        self.checks = []
        self.check_engines = _Call(self._check)
        self.engines_needing_sync = _Call(lambda: sorted(self.fenced))
        self.engine_urls = _Call(lambda: list(self.urls))
        self.confirm_weights = _Call(self._confirm)

    def _check(self, generate=False):
        self.checks.append(generate)
        restarted, self.dead = sorted(self.dead), set()
        self.fenced |= set(restarted)
        return restarted

    def _confirm(self, version):
        self.version, self.fenced = version, set()
        return []


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr(ray, "get", lambda value, **kw: value)
    monkeypatch.setattr(train, "LIVENESS_POLL_S", 0.01)


def test_a_sync_that_loses_an_engine_runs_again_with_it_rejoining():
    manager, calls = _Manager(), []

    def sync(version, restarted_urls):
        calls.append(list(restarted_urls))
        if len(calls) == 1:  # engine 1 dies mid-sync: the broadcast to it fails
            manager.dead.add(1)
            raise RuntimeError("weight sync failed: http://e1 could not be reached")
        return {"weight_sync_params": 3}

    metrics = train.sync_engines(manager, "5", sync)
    assert calls == [[], ["http://e1"]]  # the second, full sync had the restarted engine rejoin the group
    assert metrics == {"weight_sync_params": 3, "weight_sync_attempts": 2, "weight_sync_engines_restarted": 1}
    assert manager.version == "5" and manager.fenced == set()


def test_a_sync_failure_with_every_engine_alive_is_raised_as_it_is():
    manager = _Manager()

    def sync(version, restarted_urls):
        raise RuntimeError("verification failed: 2 weight(s) the draft runner serves were not written")

    with pytest.raises(RuntimeError, match="were not written"):
        train.sync_engines(manager, "5", sync)
    assert manager.checks == [False]  # one liveness check, /ping only (the sync pauses the engines)


def test_an_engine_that_keeps_dying_ends_the_run_after_the_last_attempt():
    manager = _Manager()

    def sync(version, restarted_urls):
        manager.dead.add(0)
        raise RuntimeError("lost again")

    with pytest.raises(RuntimeError, match="lost again"):
        train.sync_engines(manager, "5", sync)
    assert len(manager.checks) == train.SYNC_ATTEMPTS


def test_liveness_is_checked_while_the_sync_runs():
    """A hung engine blocks the sync's collective; the watch's check restarts it, which ends the collective."""
    manager, restarted, release = _Manager(), [], threading.Event()
    manager.dead.add(1)
    original = manager.check_engines.fn

    def check(generate=False):
        found = original(generate)
        if found:
            release.set()  # the restart ended the collective the sync waited in
        return found
    manager.check_engines = _Call(check)
    assert train.watch_engines(manager, lambda: release.wait(10) and {"ok": 1}, restarted) == {"ok": 1}
    assert restarted == [1] and manager.checks and not any(manager.checks)  # /ping, never a generated token
