"""The embedded engine serving DeepSeek-V3 holds what SGLang 0.5.23's own DeepseekV3ForCausalLM and its NextN draft
(DeepseekV3ForCausalLMNextN) hold after loading the same tensors.

A tiny DeepSeek-V3 checkpoint with one MTP layer (make-tiny-model), its tensors moved (a training step's worth, so
nothing passes on the checkpoint's values), goes to SGLang's classes on CPU (sglang_models.py, a process of its own:
MLA's `fused_qkv_a_proj_with_mqa`, FusedMoE's `w13_weight` / `w2_weight`, the float32 correction bias) and to an
EngineCore with NEXTN speculation (`load_weights`, selector "all"). The engine's `/weights_checker` answer
(engine/weights/checker.py, SGLang's WeightChecker over the engine's model under SGLang's names) equals SGLang's
merged payload checksum for checksum, in bfloat16, with the engine's projections separate and fused.

What the engine computes with those weights is checked against transformers' DeepseekV3ForCausalLM and SGLang's rotary
embedding in tests/test_engine_deepseek_v3.py: SGLang's MLA forward needs its attention backends and memory pools,
which do not run here.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conformance.sglang_models import answers_in_own_process

MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # the NextN layer's copies: never sent (the target's)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from slime_spec.tools.tiny_model import make_tiny_model
    tmp = tmp_path_factory.mktemp("engine_deepseek_v3")
    path = make_tiny_model(tmp / "m", arch="deepseek_v3", num_layers=3, mtp_layers=1, first_k_dense_replace=1,
                           seed=43, dtype="bfloat16")
    config = json.loads((path / "config.json").read_text())
    mtp = f"model.layers.{config['num_hidden_layers']}."
    gen = torch.Generator().manual_seed(43)
    sent = [(n, (t.float() + 0.01 * torch.randn(t.shape, generator=gen)).to(t.dtype))
            for n, t in sorted(load_file(str(path / "model.safetensors")).items())
            if not (n.startswith(mtp) and n.endswith(MTP_COPIES))]
    save_file(dict(sent), str(tmp / "sent.safetensors"))
    job = dict(arch="deepseek_v3", weights=str(tmp / "sent.safetensors"), config=str(path / "config.json"),
               dtype="bfloat16")
    return {"path": path, "config": config, "sent": sent, **answers_in_own_process([job], tmp)[0]}


def engine_with(case):
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.speculative.settings import SpecConfig
    core = EngineCore(str(case["path"]), SpecConfig("NEXTN", 2, 1, 3), dtype="bfloat16", max_running_requests=1)
    core.load_weights(case["sent"], selector="all")
    return core


def test_engine_checksums_equal_sglang_deepseek_v3_and_nextn(case):
    from slime_spec.engine.weights.checker import check_weights
    core = engine_with(case)
    payload = check_weights(core, {"action": "checksum", "selector": "all"})
    theirs = case["payload"]["checksums"]
    assert any(n.endswith("fused_qkv_a_proj_with_mqa.weight") for n in theirs)
    assert any(n.startswith("draft.model.decoder.self_attn.kv_b_proj") for n in theirs)
    assert {n: (payload["checksums"].get(n), c) for n, c in theirs.items() if payload["checksums"].get(n) != c} == {}
    assert payload == case["payload"]
    core.model.fuse_projections()  # as on CUDA: q_a_proj and kv_a_proj_with_mqa one tensor, the served fused one
    assert check_weights(core, {"action": "checksum", "selector": "all"}) == case["payload"]


def test_engine_holds_sglangs_router_dtypes(case):
    """SGLang's MoEGate: the correction bias float32, the router weight in the model's dtype; the engine the same."""
    core = engine_with(case)
    target = case["state"]["target"]
    ours = core.named_weights("target")
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert ours[name].dtype == target[name].dtype and torch.equal(ours[name], target[name]), name
