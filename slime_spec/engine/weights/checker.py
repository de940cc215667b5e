"""`/weights_checker` for the embedded engine: SGLang's own WeightChecker over our model, exposed as SGLang serves it.

SGLang's scheduler answers `CheckWeightsReqInput` by running each selected runner's `WeightChecker.handle`
(utils/weight_checker.py) over that runner's model and merging the per-role payloads
(`_merge_checksum_payloads`: target keys unprefixed, a draft's prefixed with its role). On the embedded engine
that manager itself runs (engine/weights/updater.py) and each of our runners answers with `runner_checksums`:
SGLang's `WeightChecker.handle` over a view of the embedded model under SGLang's parameter names and values
(`check_weights` merges them the same way for callers without the scheduler process):
`EngineCore.named_weights(role)` (checkpoint names) mapped by weight_sync/verify/sglang_params.py, the module the
trainer
side hashes with too. So an engine, a trainer and SGLang's own model classes give equal checksums
for equal weights (tests/conformance/test_weight_checker.py).

Actions: SGLang's `checksum`. SGLang's `snapshot` / `compare` / `reset_tensors` act on the model's own memory,
which the view here copies: they are refused, as is slime-spec's former `names` extension (served names without
hashing), which SGLang's reply struct (`CheckWeightsReqOutput`, one ChecksumInfo per rank) cannot carry.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from slime_spec.weight_sync.verify.sglang_params import CAUSAL_LM, EAGLE3, RunnerLayout, served_tensors

CHECKSUM_ACTION = "checksum"
NAMES_ACTION = "names"  # slime-spec's former extension (names without hashing): refused, see the module docstring
# gpu_tensor_hash hashes tiles of words, then reduces the per-tile hashes: sizes of 2, 17 and 128 tiles (a weight of
# 1M words has 128 at its default 8192-word tile) compile its tile kernel and its reduce kernel for such counts
WARM_TILE_COUNTS = (2, 17, 128)


class ServedView(nn.Module):
    """A runner's model as SGLang holds it: its served tensors as parameters under SGLang's names."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self._names = list(tensors)
        for i, tensor in enumerate(tensors.values()):
            self.register_parameter(f"p{i}", nn.Parameter(tensor, requires_grad=False))

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, (_, param) in zip(self._names, super().named_parameters(prefix, recurse, remove_duplicate)):
            yield name, param


def runner_layout(core, role: str, named: dict[str, torch.Tensor]) -> RunnerLayout | None:
    """How SGLang would serve runner `role` of this engine; None where that runner holds no weights (no draft,
    n-gram / history drafting). The engine's tensors are in its own dtype already."""
    if role == "target":  # the config's experts, MTP layers skipped (GLM-4.5's model.layers.{N}), float32 routers
        return RunnerLayout.target(core.model_config, None)
    if not named:
        return None
    from slime_spec.engine.drafters import Eagle3Drafter, HybridDrafter, MTPDrafter, StandaloneDrafter
    drafter = core.drafter.mtp if isinstance(core.drafter, HybridDrafter) else core.drafter
    if isinstance(drafter, MTPDrafter):  # MiMoMTP, or GLM-4.5's NextN class
        return RunnerLayout.mtp_draft(core.model_config, None)
    if isinstance(drafter, Eagle3Drafter):
        return RunnerLayout(EAGLE3)
    if isinstance(drafter, StandaloneDrafter):
        args = drafter.draft.args
        return RunnerLayout(CAUSAL_LM, args.tie_word_embeddings, num_experts=args.num_experts)
    raise ValueError(f"the {type(drafter).__name__} draft runner has weights but no SGLang layout here")


def runner_weights(core, role: str) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors runner `role` loads; an EAGLE3 draft also holds the target's embedding."""
    core.memory.complete_weights()  # their values are read
    named = dict(core.named_weights(role))
    if role != "target" and named and "model.embed_tokens.weight" not in named:
        from slime_spec.engine.drafters import Eagle3Drafter
        if isinstance(core.drafter, Eagle3Drafter):  # SGLang's set_embed: the draft serves the target's
            named = {"model.embed_tokens.weight": core.model.model.embed_tokens.weight.detach(), **named}
    return named


def runner_checksums(core, role: str, action: str = CHECKSUM_ACTION, allow_quant_error: bool = False,
                     skip_tensor_list: list[str] | None = None) -> dict | None:
    """What SGLang's `ModelRunner.check_weights` answers for runner `role`: `WeightChecker.handle` over the runner's
    served tensors (SGLang's names and values), or None where that runner holds no weights. Runs on the engine
    thread; raises ValueError for an action this engine cannot run (SGLang's manager answers it as success false)."""
    from slime_spec.engine import sglang_stand_ins
    sglang_stand_ins.install()
    from sglang.srt.utils.weight_checker import WeightChecker

    if action != CHECKSUM_ACTION:
        raise ValueError(f"Unsupported action={action!r}: the embedded engine runs SGLang's '{CHECKSUM_ACTION}' only "
                         "(snapshot/compare/reset_tensors act on the model's own memory)")
    named = runner_weights(core, role)
    layout = runner_layout(core, role, named)
    if layout is None:
        return None
    if core.fp8 is not None:  # SGLang hashes an FP8 weight's bfloat16 dequantization, which this engine holds
        named = {n: t.to(torch.bfloat16) if core.fp8.quantizes(n) else t for n, t in named.items()}
    view = ServedView(served_tensors(named.items(), layout))
    return _checker(WeightChecker, view).handle(action, bool(allow_quant_error), list(skip_tensor_list or []) or None,
                                                role=role)


def check_weights(core, req: dict) -> dict | None:
    """SGLang's scheduler-side `check_weights` (the payload before its reply struct), for callers without the
    scheduler process: the merged ChecksumInfo of the runners `req["selector"]` reaches, or None when none of them
    holds weights. The engine's `/weights_checker` runs SGLang's manager itself (weight_updater.EngineWeights)."""
    from slime_spec.engine import sglang_stand_ins
    sglang_stand_ins.install()
    from sglang.srt.managers.scheduler_components.weight_updater import _merge_checksum_payloads, _parse_runner_selector

    roles = _parse_runner_selector(req.get("selector", "all"))
    payloads: list[tuple[str, dict[str, Any]]] = []
    for role in ("target", "draft"):
        if role in roles:
            payload = runner_checksums(core, role, req.get("action", CHECKSUM_ACTION),
                                       req.get("allow_quant_error", False), req.get("skip_tensor_list"))
            if payload is not None:
                payloads.append((role, payload))
    return _merge_checksum_payloads(payloads) if payloads else None


def _checker(cls, model: nn.Module):
    """SGLang's WeightChecker over `model`; it records the runner's placement from SGLang's parallel state, which
    the embedded engine (one rank) states here."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0, tp_size=1, dp_rank=0, attn_dp_size=1, pp_rank=0, pp_size=1):
        return cls(get_model=lambda: model)


def warm_checksum_kernels(device: torch.device) -> float:
    """Compile SGLang's content hash of CUDA tensors (`mm_utils.tensor_hash` -> Triton `gpu_tensor_hash`, what
    `WeightChecker` hashes with) at engine start; returns its seconds. Otherwise the first `/weights_checker`, which
    a sync reads before its first update, pays the compile: 6.6 s on an H200 without a Triton cache, 0.04 s once
    compiled (411 bf16 tensors, 0.84 GB). Nothing to compile on CPU (SGLang hashes a CPU tensor with hashlib)."""
    if device.type != "cuda":
        return 0.0
    from slime_spec.engine import sglang_stand_ins
    sglang_stand_ins.install()
    import inspect

    from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash
    from sglang.srt.managers.mm_utils import tensor_hash

    tile_words = inspect.signature(gpu_tensor_hash).parameters["tile_words"].default  # what tensor_hash tiles with
    t0 = time.perf_counter()
    for tiles in WARM_TILE_COUNTS:
        tensor_hash(torch.zeros(tiles * tile_words, dtype=torch.int32, device=device))
    return time.perf_counter() - t0
