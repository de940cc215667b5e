"""Our weight-update sender (slime_spec.common.dist_group) against SGLang's own receiver.

Rank 0 is our `WeightUpdateGroup` in this process; rank 1 is SGLang 0.5.23's model-runner
`WeightUpdater` (init_custom_process_group + receive_weights_from_distributed) in a second process,
over gloo on 127.0.0.1. Every bucket must arrive bit for bit, with SGLang reading our dtype names, tensor by
tensor and as one flattened bucket (`load_format: "flattened_bucket"`, which SGLang lays out itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime_spec.common.dist_group import WeightUpdateGroup
from slime_spec.common.net import free_port
from slime_spec.weight_sync.transports.http_transports import broadcast_plan, dtype_name

ROOT = Path(__file__).resolve().parents[2]
JOIN_TIMEOUT_S = 60.0


def buckets() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    return [
        [("model.embed_tokens.weight", torch.randn(64, 16, generator=g).to(torch.bfloat16)),
         ("model.norm.weight", torch.randn(16, generator=g))],
        [("model.layers.0.mlp.gate_up_proj.weight", torch.randn(8, 4, 2, generator=g).to(torch.float16)),
         ("lm_head.weight", torch.randn(3, 16, generator=g, dtype=torch.float64)),
         ("model.layers.0.step", torch.arange(7, dtype=torch.int64)),
         ("model.mtp.scalar", torch.tensor(2.5))],
    ]


@pytest.mark.parametrize("flatten", [False, True])  # one broadcast per tensor; one per bucket (flattened_bucket)
def test_our_sender_meets_sglangs_receiver(tmp_path, flatten):
    port = free_port()
    wire = [broadcast_plan(b, flatten) for b in buckets()]
    plan = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "weight_update_group", "tp_rank": 0, "default_group_file": str(tmp_path / "default_pg"),
            "buckets": [{"names": [n for n, _, _ in specs], "dtypes": [dtype_name(d) for _, d, _ in specs],
                         "shapes": [shape for _, _, shape in specs],
                         "load_format": "flattened_bucket" if flatten else None} for specs, _ in wire]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    receiver = subprocess.Popen([sys.executable, "-m", "tests.conformance.sglang_receiver", str(tmp_path / "plan.json"),
                                 str(tmp_path / "out.pt")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        group = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=2, backend="gloo", timeout_s=JOIN_TIMEOUT_S)
        for _, tensors in wire:
            for tensor in tensors:
                group.broadcast(tensor, src=0)
        output, _ = receiver.communicate(timeout=JOIN_TIMEOUT_S)
        group.destroy()
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    assert receiver.returncode == 0, output
    received = torch.load(tmp_path / "out.pt")
    sent = dict(kv for b in buckets() for kv in b)
    assert sorted(received) == sorted(sent)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape, name
        assert torch.equal(received[name], tensor), name
