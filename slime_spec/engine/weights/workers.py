"""What SGLang's SchedulerWeightUpdaterManager calls on its scheduler, presented by the embedded engine.

SGLang's manager (managers/scheduler_components/weight_updater.py) reaches the model through the scheduler's TP
worker and spec worker and their model runners. These classes are those, for the embedded engine (one rank, TP 1):
- `EngineTpWorker`, as SGLang's TpModelWorker: `model_runner`, `weight_update_runners()`,
  `init_weights_update_group`, `destroy_weights_update_group`, `deserialize_own_rank`, `get_weights_by_name`;
- `EngineDraftWorker`, as SGLang's spec workers: `weight_update_runners()`, empty where the draft holds no weights
  (n-gram and history drafting);
- `EngineRunner` per role, as SGLang's ModelRunner: its `weight_updater` (begin/end, receive and load a
  distributed update, load tensors, load from disk, IPC) and `check_weights` (SGLang's WeightChecker over our model
  under SGLang's names, engine/weights/checker.py).
Each forwards to `weight_updater.EngineWeights`, which loads an update once for every runner it reaches.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slime_spec.engine.weights.updater import EngineWeights, Received
def deserialize_named_tensors(payload: Any) -> Any:
    """One rank's entry (base64 str or bytes) -> what the producer pickled, through SGLang's SafeUnpickler.

    torch's CUDA-IPC rebuild is patched first, as SGLang's TP worker does: the producer names its device by UUID
    (weight_sync/transports/tensor_payload.py), which the patched rebuild maps to this process's device index."""
    from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payload
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.deserialize(normalize_serialized_named_tensor_payload(payload))


class EngineRunnerUpdater:
    """SGLang's model-runner WeightUpdater, for one role of the embedded engine."""

    def __init__(self, weights: "EngineWeights", role: str):
        self.weights, self.role = weights, role

    def begin_weight_update(self) -> None:
        """SGLang restores in-place-packed weights here; ours are served as loaded."""

    def end_weight_update(self, *, run_post_load: bool) -> None:
        """SGLang post-processes the loaded weights here; ours need none."""

    def receive_weights_from_distributed(self, *, names, dtypes, shapes, group_name, load_format=None) -> Received:
        return self.weights.receive(names, dtypes, shapes, group_name, load_format)

    def load_weights_from_distributed(self, named: Received) -> tuple[bool, str]:
        return self.weights.load_once(lambda: self.weights.load_received(named))

    def update_weights_from_tensor(self, named_tensors, load_format=None) -> tuple[bool, str]:
        return self.weights.load_once(lambda: self.weights.load_tensors(named_tensors, load_format))

    def update_weights_from_disk(self, model_path, load_format, weight_name_filter=None,
                                 recapture_cuda_graph=False) -> tuple[bool, str]:
        return self.weights.load_once(lambda: self.weights.load_from_disk(model_path))

    def update_weights_from_ipc(self, recv_req) -> tuple[bool, str]:
        return False, ("update_weights_from_ipc (checkpoint-engine's ZMQ handles) is not supported by the embedded "
                       "engine; use update_weights_from_distributed or update_weights_from_tensor")


class EngineRunner:
    """SGLang's ModelRunner as the manager sees it: a weight updater and a weight checker for one role."""

    def __init__(self, weights: "EngineWeights", role: str):
        self.weights, self.role = weights, role
        self.weight_updater = EngineRunnerUpdater(weights, role)

    def check_weights(self, action: str, allow_quant_error: bool = False, skip_tensor_list=None, *, role: str):
        from slime_spec.engine.weights.checker import runner_checksums
        return runner_checksums(self.weights.core, role, action, allow_quant_error, skip_tensor_list)


class EngineDraftWorker:
    def __init__(self, runner: EngineRunner):
        self.runner = runner

    def weight_update_runners(self) -> list[tuple[str, EngineRunner]]:
        """As SGLang's spec workers: [] when the draft owns no weights (n-gram and history drafting)."""
        core = self.runner.weights.core
        drafter = core.drafter
        if drafter is None or not drafter.owns_weights:
            return []
        return [("draft", self.runner)]


class EngineTpWorker:
    """SGLang's TpModelWorker as the manager sees it (one rank: the embedded engine is TP 1)."""

    def __init__(self, weights: "EngineWeights"):
        self.weights = weights
        self.model_runner = EngineRunner(weights, "target")

    def weight_update_runners(self) -> list[tuple[str, EngineRunner]]:
        return [("target", self.model_runner)]

    def init_weights_update_group(self, recv_req) -> tuple[bool, str]:
        return self.weights.init_group(recv_req)

    def destroy_weights_update_group(self, recv_req) -> tuple[bool, str]:
        return self.weights.destroy_group(recv_req.group_name)

    def deserialize_own_rank(self, serialized_named_tensors):
        """Rank 0's entry (the embedded engine is rank 0), through SGLang's SafeUnpickler."""
        if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
            raise ValueError("Failed to deserialize serialized_named_tensors: expected a non-empty list (one entry "
                             "per TP rank)")
        try:
            return deserialize_named_tensors(serialized_named_tensors[0])
        except (RuntimeError, ValueError, TypeError, KeyError, pickle.UnpicklingError) as e:
            raise ValueError(f"Failed to deserialize serialized_named_tensors: {e}") from e

    def get_weights_by_name(self, recv_req) -> list | None:
        """The target runner's tensor as float32 nested lists, its first `truncate_size` rows (SGLang's Llama)."""
        self.weights.core.memory.complete_weights()
        weights = self.weights.core.named_weights("target")
        name = recv_req.name
        if name not in weights and name == "lm_head.weight":
            name = "model.embed_tokens.weight"  # tied embeddings, as SGLang answers
        if name not in weights:
            return None
        t = weights[name]
        t = t[: int(recv_req.truncate_size)] if t.dim() else t  # slice before the (slow) list conversion
        return t.float().cpu().tolist()
