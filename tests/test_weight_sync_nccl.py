"""The split layout's NCCL weight-update group on two GPUs: trainer (this process) on GPU 0, the embedded engine
(`python -m slime_spec.engine`) on GPU 1. Runs on the lent GPU machine; CI has no GPU and skips it.

Checks that a sync lands, that closing the group returns (the trainer and the engine destroy it together), and
that an engine restarted after a close, and one restarted (killed) while the group was open, both rejoin a NEW
group on a fresh port and take the next sync; and that a trainer and an engine that disagree on NCCL_CUMEM_ENABLE
fail the sync with an error naming it (NCCL hung there). The engine inherits this process's environment: run it as
is (both sides take NCCL_CUMEM_ENABLE=0) and with NCCL_CUMEM_ENABLE=1, where an NCCL teardown waits for every rank,
the case that hung when the two sides destroyed the group one after the other.
"""

from __future__ import annotations

import os

import pytest
import torch

from slime_spec.common.net import free_port
from slime_spec.config.run_config import WeightSyncConfig
from slime_spec.fleet.client import EngineClient, EngineGroupError
from slime_spec.fleet.process import embedded_server_process
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.weight_sync.gather import iter_hf_state
from slime_spec.weight_sync.protocol import SpecSetup
from slime_spec.weight_sync.sync import WeightSyncer, WeightSyncError

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (the lent GPU machine)")

TINY = dict(arch="mimo", vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            intermediate_size=256, max_position_embeddings=256, dtype="bfloat16", mtp_layers=1)
EAGLE_FLAGS = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
               "--speculative-num-draft-tokens", "2"]


def _state(path):
    from safetensors.torch import load_file

    return {n: t for f in sorted(path.glob("*.safetensors")) for n, t in load_file(str(f)).items()}


def _config(path):
    import json

    return json.loads((path / "config.json").read_text())


def _engine(tmp_path, served, env: dict):
    return embedded_server_process(served, ["--device", "cuda", *EAGLE_FLAGS], log_path=tmp_path / "engine.log",
                                   port=free_port(), env={"CUDA_VISIBLE_DEVICES": "1", **env}).start(timeout_s=300)


def _syncer(client: EngineClient, served) -> WeightSyncer:
    return WeightSyncer([client], WeightSyncConfig(check_weight_sync=True, weight_sync_check_interval=1),
                        hf_config=_config(served), hf_checkpoint=served, spec=SpecSetup("EAGLE", None, str(served)),
                        has_mtp_layers=True, transport="distributed", backend="nccl",
                        timeout_s=120)


def test_close_returns_and_a_restarted_engine_rejoins_a_new_group(tmp_path):
    served = make_tiny_model(tmp_path / "served", seed=0, **TINY)
    policies = [make_tiny_model(tmp_path / f"policy{i}", seed=i, **TINY) for i in (1, 2, 3)]
    engine = _engine(tmp_path, served, {})
    try:
        client = EngineClient(engine.url)
        syncer = _syncer(client, served)

        def sync(i: int, version: str) -> None:
            report = syncer.sync_report(iter_hf_state(_state(policies[i]), _config(policies[i])), version)
            assert report.checked and client.get("/model_info")["weight_version"] == version

        sync(0, "1")
        first_port = syncer.transport.group_port
        syncer.close()  # returned: both sides destroyed the group together
        assert syncer.transport.group is None

        # restarted after a clean close: it serves the checkpoint and joins a new group on a fresh port
        engine.stop()
        engine.start(timeout_s=300)
        syncer.rejoin([engine.url])
        sync(1, "2")
        assert syncer.transport.group_port != first_port

        # killed while the group was open: this side leaves the old group alone, the new engine joins a new one
        engine.stop(grace_s=0)
        engine.start(timeout_s=300)
        syncer.rejoin([engine.url])
        sync(2, "3")
        syncer.close()
    finally:
        engine.stop()


def test_a_trainer_and_engine_that_disagree_on_nccl_cumem_fail_with_its_name(tmp_path):
    served = make_tiny_model(tmp_path / "served", seed=0, **TINY)
    trainer_value = os.environ.get("NCCL_CUMEM_ENABLE", "0")
    engine = _engine(tmp_path, served, {"NCCL_CUMEM_ENABLE": "1" if trainer_value == "0" else "0"})
    try:
        syncer = _syncer(EngineClient(engine.url), served)
        with pytest.raises(WeightSyncError, match="NCCL_CUMEM_ENABLE is"):
            syncer.sync(iter_hf_state(_state(served), _config(served)), "1")
        with pytest.raises(EngineGroupError, match="does not exist"):  # the engine never joined
            syncer.close()
    finally:
        engine.stop()
