"""An engine lost mid-broadcast: the sync fails at once instead of waiting out the group's timeout, the other
engines leave the broken collective, and an engine that cannot leave it is named to be restarted.

The engines are FakeSGLangServer doubles (tests/test_weight_sync_fake_server.py) receiving over a real gloo group,
with the trainer's side a WeightSyncer over the distributed transport. The engine that dies runs in a process of its
own and is SIGKILLed just before the sync's first bucket is broadcast (the group formed, the session open), where
tests/helpers/engine_faults.py kills one in the e2e run.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest

from slime_spec.config.run_config import WeightSyncConfig
from slime_spec.fleet.client import EngineClient
from slime_spec.tools.tiny_model import make_config, make_weights
from slime_spec.weight_sync.gather import iter_hf_state
from slime_spec.weight_sync.protocol import SpecSetup
from slime_spec.weight_sync.sync import WeightSyncer, WeightSyncError
from slime_spec.weight_sync.transports import http_transports as transports
from tests.test_weight_sync_fake_server import FakeSGLangServer

MIMO = make_config("mimo", vocab_size=48, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                   intermediate_size=64, max_position_embeddings=128, dtype="float32", mtp_layers=1,
                   tie_word_embeddings=False)
GROUP_TIMEOUT_S = 120  # the engines' receives would wait this long for a sender that left without closing


@pytest.fixture
def servers():
    made = []
    yield lambda: made.append(FakeSGLangServer(make_weights(MIMO, seed=0), MIMO, draft="mtp")) or made[-1]
    for s in made:
        s.close()


def distributed_syncer(servers: list) -> WeightSyncer:
    config = WeightSyncConfig(weight_sync_transport="distributed", check_weight_sync=False,
                              weight_sync_check_interval=1)
    return WeightSyncer([EngineClient(s.url) for s in servers], config, hf_config=MIMO, hf_checkpoint="/nonexistent",
                        spec=SpecSetup("EAGLE", None, "/ckpt"), has_mtp_layers=True, transport="distributed",
                        timeout_s=GROUP_TIMEOUT_S)


def serve_fake_engine(conn) -> None:
    """A FakeSGLangServer in a process of its own, until it is killed."""
    server = FakeSGLangServer(make_weights(MIMO, seed=0), MIMO, draft="mtp")
    conn.send(server.url)
    threading.Event().wait()


class FakeEngineProcess:
    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_fake_engine, args=(child,), daemon=True)
        self.proc.start()
        if not parent.poll(GROUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError("the fake engine process did not start")
        self.url = parent.recv()

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join()


@pytest.fixture
def victim():
    engine = FakeEngineProcess()
    yield engine
    engine.kill()


def kill_before_first_bucket(syncer: WeightSyncer, victim: FakeEngineProcess) -> None:
    syncer.prepare()
    post = syncer.transport.post

    def post_after_kill(*args, **kwargs):
        victim.kill()
        return post(*args, **kwargs)

    syncer.transport.post = post_after_kill


def record_replies(server: FakeSGLangServer, path: str) -> list[tuple[int, dict]]:
    replies, handle = [], server.handle

    def recording(method, p, body):
        out = handle(method, p, body)
        if p == path:
            replies.append(out)
        return out

    server.handle = recording
    return replies


def test_a_member_lost_mid_broadcast_releases_the_others_at_once(servers, victim):
    """The trainer leaves the broken group, which closes its connections: the survivor's pending receive fails with
    the lost connection (not the group's timeout), it keeps the previous weights and generates again; nothing is
    left stuck, and the dead engine is named unreachable for the fleet to restart and re-sync."""
    survivor = servers()
    syncer = distributed_syncer([survivor, victim])
    syncer.sync(iter_hf_state(make_weights(MIMO, seed=1), MIMO), weight_version="1")
    replies = record_replies(survivor, "/update_weights_from_distributed")
    kill_before_first_bucket(syncer, victim)
    with pytest.raises(WeightSyncError) as err:
        syncer.sync(iter_hf_state(make_weights(MIMO, seed=2), MIMO), weight_version="2")
    (status, reply), = replies  # it left the broadcast on the first bucket
    assert status == 400 and "GroupBroken" in reply["message"], reply
    assert "Connection closed" in reply["message"] or "Connection reset" in reply["message"], reply
    assert err.value.stuck_urls == []
    alive, dead = err.value.engines
    assert (alive.serves, alive.weight_version, alive.agree) == ("previous", "1", alive.total)
    assert dead.serves == "unreachable"
    assert err.value.engines_serve_previous_weights and not survivor.paused
    assert survivor.group is None  # it left the group too
    assert syncer.transport.group is None  # the next sync forms a new group


def test_an_engine_stuck_in_the_broken_broadcast_is_named_and_asked_nothing_more(servers, victim, monkeypatch):
    """An engine whose receive cannot tell that a peer is gone (as an NCCL receive waits out its timeout, 30 min by
    SGLang's default) does not answer: after BROKEN_GROUP_REPLY_S the sync fails naming it stuck, to be restarted,
    and sends it nothing more (each of its routes would wait behind the blocked receive)."""
    stuck = servers()
    syncer = distributed_syncer([stuck, victim])
    syncer.sync(iter_hf_state(make_weights(MIMO, seed=1), MIMO), weight_version="1")
    entered, released, handle = threading.Event(), threading.Event(), stuck.handle

    def blocked_receive(method, path, body):
        if path == "/update_weights_from_distributed":
            entered.set()
            released.wait(GROUP_TIMEOUT_S)
            return 400, {"success": False, "message": "the receive timed out"}
        return handle(method, path, body)

    stuck.handle = blocked_receive
    monkeypatch.setattr(transports, "BROKEN_GROUP_REPLY_S", 1.0)
    kill_before_first_bucket(syncer, victim)
    before = len(stuck.calls)
    try:
        with pytest.raises(WeightSyncError) as err:
            syncer.sync(iter_hf_state(make_weights(MIMO, seed=2), MIMO), weight_version="2")
        assert entered.is_set()  # then nothing more: every route after the blocked receive waits behind it
        assert [p for p, _ in stuck.calls[before:]] == ["/pause_generation", "/begin_weight_update"]
    finally:
        released.set()
    assert err.value.stuck_urls == [stuck.url]
    verdict, dead = err.value.engines
    assert verdict.serves == "unreachable" and "stuck in the broken broadcast" in verdict.reason
    assert dead.serves == "unreachable"
    assert f"engine(s) {stuck.url} did not answer /update_weights_from_distributed within 1 s" in str(err.value)
    assert "Restart them" in str(err.value)
