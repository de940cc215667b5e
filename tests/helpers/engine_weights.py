"""The engine thread's weight side driven in this process with SGLang's own request structs (no HTTP, no scheduler
process): SGLang's SchedulerWeightUpdaterManager over the embedded engine's runners (engine/weights/updater.py)."""

import torch

from slime_spec.engine import sglang_stand_ins
from slime_spec.weight_sync.transports.tensor_payload import serialize_named_tensors


def engine_weights(core, device: str = "cpu"):
    """The engine thread's weight side (SGLang's SchedulerWeightUpdaterManager over our runners), in this process."""
    from slime_spec.engine.weights.updater import EngineWeights
    return EngineWeights(core, "v0", device)


def request(kind: str, **fields):
    """SGLang's own request struct, as its TokenizerManager sends it to the scheduler."""
    sglang_stand_ins.install()
    from sglang.srt.managers import io_struct

    return getattr(io_struct, kind)(**fields)


def begin(weights, selector: str):
    return weights.handle(request("BeginWeightUpdateReqInput", selector=selector))


def tensor_update(weights, selector: str, named):
    return weights.handle(request("UpdateWeightsFromTensorReqInput", selector=selector,
                                  serialized_named_tensors=[serialize_named_tensors(named)]))


def abort(weights):
    from slime_spec.engine.entrypoints.http_server import ABORT_SESSION_RID
    return weights.handle(request("EndWeightUpdateReqInput", rid=ABORT_SESSION_RID))


def served_bytes(core) -> dict[str, torch.Tensor]:
    return {f"{role}.{n}": t.clone() for role in ("target", "draft") for n, t in core.named_weights(role).items()}


def update_bucket(weights, names, value, target):
    reply = tensor_update(weights, "target", [(n, torch.full_like(target[n], value)) for n in names])
    assert reply.success, reply
    return weights.last_timing
