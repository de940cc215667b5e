"""Closing the weight-update group: the trainer and every engine destroy it together, bounded by a timeout.

With NCCL's cuMem buffers (NCCL's default) a rank's teardown returns only once every rank tears down (seen on
two H200s, NCCL 2.28.9: an engine's destroy returned when the trainer destroyed, 15 s later). `CollectiveTeardown`
is a test double of that wait for the CPU, where gloo's teardown is local: each rank's `WeightUpdateGroup.destroy`
waits, for a bounded time, until every rank has entered its own. A close that destroys one side after the other
fails here after that bound instead of hanging. The real NCCL case runs in tests/test_weight_sync_nccl.py on two GPUs.
"""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from slime_spec.common import dist_group
from slime_spec.common.dist_group import GroupCloseTimeout, WeightUpdateGroup
from slime_spec.common.net import free_port
from slime_spec.config.run_config import WeightSyncConfig
from slime_spec.fleet.client import EngineClient
from slime_spec.tools.tiny_model import make_config, make_weights
from slime_spec.weight_sync.gather import iter_hf_state
from slime_spec.weight_sync.protocol import SpecSetup
from slime_spec.weight_sync.sync import WeightSyncer
from tests.test_weight_sync_fake_server import FakeSGLangServer

MIMO = make_config("mimo", vocab_size=48, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                   intermediate_size=64, max_position_embeddings=128, dtype="float32", mtp_layers=1,
                   tie_word_embeddings=False)
WAIT_S = 30.0  # the double's bound on waiting for the other ranks: a regression fails after it, never hangs


class CollectiveTeardown:
    """Every rank's destroy waits (at most WAIT_S) until all `ranks` have entered theirs, then destroys."""

    def __init__(self, ranks: int):
        self.barrier = threading.Barrier(ranks, timeout=WAIT_S)
        self.entered: list[int] = []
        self._destroy = WeightUpdateGroup.destroy

    def install(self, monkeypatch) -> "CollectiveTeardown":
        def destroy(group: WeightUpdateGroup, *args, **kwargs) -> None:
            self.entered.append(group.rank)
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                raise RuntimeError(f"rank {group.rank} destroyed the group, but not every other rank did within "
                                   f"{WAIT_S:g} s") from None
            self._destroy(group, *args, **kwargs)

        monkeypatch.setattr(WeightUpdateGroup, "destroy", destroy)
        return self


@pytest.fixture
def engine():
    server = FakeSGLangServer(make_weights(MIMO, seed=0), MIMO, draft="mtp")
    yield server
    server.close()


def synced_syncer(server: FakeSGLangServer) -> WeightSyncer:
    """A distributed (gloo) syncer whose group is formed: one sync has run."""
    syncer = WeightSyncer([EngineClient(server.url)], WeightSyncConfig(update_weight_buffer_size=4096),
                          hf_config=MIMO, hf_checkpoint="/nonexistent", spec=SpecSetup("EAGLE", None, "/ckpt"),
                          has_mtp_layers=True, transport="distributed", timeout_s=60)
    syncer.sync(iter_hf_state(make_weights(MIMO, seed=1), MIMO), weight_version="1")
    assert server.group is not None and syncer.transport.group is not None
    return syncer


def test_close_destroys_the_group_on_both_sides_together(engine, monkeypatch):
    syncer = synced_syncer(engine)
    teardown = CollectiveTeardown(ranks=2).install(monkeypatch)
    syncer.close()
    assert sorted(teardown.entered) == [0, 1]
    assert engine.group is None and syncer.transport.group is None
    syncer.close()  # idempotent: nothing left to destroy


def test_engines_that_do_not_answer_the_destroy_fail_the_close_with_a_clear_error(engine, monkeypatch):
    syncer = synced_syncer(engine)
    release = threading.Event()
    engine_group = engine.group
    monkeypatch.setattr(engine_group, "destroy", lambda *a, **k: release.wait(WAIT_S))  # an engine stuck in it
    monkeypatch.setattr(dist_group, "DESTROY_TIMEOUT_S", 0.5)
    try:
        with pytest.raises(GroupCloseTimeout, match="did not answer /destroy_weights_update_group of group "
                                                    "'weight_update_group' within 0.5 s"):
            syncer.close()
        assert syncer.transport.group is None  # this side left the group all the same
    finally:
        release.set()
        WeightUpdateGroup.destroy(engine_group)


def test_a_destroy_that_never_finishes_is_aborted_and_named(monkeypatch):
    group = WeightUpdateGroup("127.0.0.1", free_port(), rank=0, world_size=1, group_name="close_test", timeout_s=30)
    pg, real_destroy = group._pg, dist.destroy_process_group
    release = threading.Event()
    monkeypatch.setattr(dist, "destroy_process_group", lambda pg: release.wait(WAIT_S))  # a peer that never comes
    monkeypatch.setattr(dist_group, "ABORT_GRACE_S", 0.0)
    try:
        with pytest.raises(GroupCloseTimeout, match=r"destroying weight-update group 'close_test' \(rank 0 of 1, "
                                                    r"gloo\) did not finish in 0.2 s.*Every rank must destroy"):
            group.destroy(timeout_s=0.2)
    finally:
        release.set()
        real_destroy(pg)
    group.destroy()  # idempotent


def test_train_actors_turn_nccls_cumem_buffers_off():
    from slime_spec.trainer.group import train_actor_env
    assert train_actor_env(True, 2, environ={}) == {"NCCL_CUMEM_ENABLE": "0"}
    assert train_actor_env(True, 2, environ={"NCCL_CUMEM_ENABLE": "1"}) == {"NCCL_CUMEM_ENABLE": "1"}  # the job's
    cpu = train_actor_env(False, 2, environ={})
    assert cpu["NCCL_CUMEM_ENABLE"] == "0" and int(cpu["OMP_NUM_THREADS"]) >= 1
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""  # CPU ranks on a machine with a GPU: gloo, not NCCL on one device


def test_members_that_disagree_on_nccl_cumem_are_refused(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    dist_group.check_same_cumem(store, rank=0)
    dist_group.check_same_cumem(store, rank=1)  # the same value: joins
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    with pytest.raises(ValueError, match=r"NCCL_CUMEM_ENABLE is 1 here \(rank 1\) but 0 on rank 0 \(the trainer\)"):
        dist_group.check_same_cumem(store, rank=1)
