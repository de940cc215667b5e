"""What our weight sync sends to an engine serving DeepSeek-V3's block-wise FP8 checkpoint, loaded by SGLang 0.5.23's
own FP8 model classes on CPU.

A tiny DeepSeek-V3 written FP8 as the released checkpoint is (`make-tiny-model --fp8`: float8_e4m3fn projections,
float32 `weight_scale_inv` per 128 x 128 block, its `quantization_config`) is read by the trainer's model (dequantized),
moved (a training step's worth) and sent back through the sync's own path: Megatron -> HF (`gather.iter_hf_tensors`),
then `gather.quantized`, as `TrainActor.sync_weights` sends it. SGLang builds `DeepseekV3ForCausalLM` and the NextN
draft `DeepseekV3ForCausalLMNextN` with the `Fp8Config` its loader makes from that config (sglang_models.py), each
loads the tensors with its own `load_weights`, and SGLang's WeightChecker answers `/weights_checker`. Then:

- every FP8 parameter SGLang holds (fused `fused_qkv_a_proj_with_mqa`, `gate_up_proj`, FusedMoE's `w13_weight` /
  `w2_weight`, each with its stacked `weight_scale_inv`), dequantized by SGLang's `block_quant_dequant`, is the
  trainer's value within one FP8 unit in the last place (SGLang's own `_quant_ulp`, scaled by the block);
- our model of the served layout (`sglang_params.served_tensors`) equals SGLang's parameters bit for bit, FP8 codes
  and scales included, but for the attention's KV-cache scales SGLang creates under an FP8 config (no checkpoint
  writes them: they keep SGLang's -1 placeholder, and its WeightChecker skips them);
- our checksums (`ServedChecksums`: an FP8 weight hashed as SGLang's `Fp8BlockComparable` dequantizes it) equal
  SGLang's WeightChecker's, and the coverage check finds every served weight written.
"""

from __future__ import annotations

import json

import pytest
import torch

from slime_spec.weight_sync import fp8
from slime_spec.weight_sync.verify import coverage as verify
from slime_spec.weight_sync.verify.sglang_params import RunnerLayout, ServedChecksums, served_tensors
from tests.conformance.sglang_models import SKIPPED_BY_SGLANG, answers_in_own_process
from tests.conformance.test_model_load_mla_moe import megatron_weights

KV_CACHE_SCALES = (".k_scale", ".v_scale")  # RadixAttention's under a quantization config (kv_cache.py)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from safetensors.torch import save_file

    from slime_spec.tools.tiny_model import make_tiny_model
    from slime_spec.weight_sync.gather import NamedTensor, iter_hf_tensors, quantized
    tmp = tmp_path_factory.mktemp("sglang_fp8")
    path = make_tiny_model(tmp / "ds", arch="deepseek_v3", mtp_layers=1, seed=43, dtype="bfloat16", hidden_size=512,
                           intermediate_size=256, fp8=True)
    config = json.loads((path / "config.json").read_text())
    gen = torch.Generator().manual_seed(43)
    moved = [(n, t.float() + 0.01 * torch.randn(t.shape, generator=gen)) for n, t in megatron_weights(path, config)]
    trained = {t.name: t.tensor.clone() for t in iter_hf_tensors(moved, config)}
    scheme = fp8.Fp8BlockScheme.from_hf_config(config)
    sent = [(t.name, t.tensor) for t in quantized((NamedTensor(n, t) for n, t in trained.items()), scheme)]
    save_file({n: t.contiguous() for n, t in sent}, str(tmp / "sent.safetensors"))
    job = dict(arch="deepseek_v3", weights=str(tmp / "sent.safetensors"), config=str(path / "config.json"),
               dtype="bfloat16")
    (answer,) = answers_in_own_process([job], tmp)
    return {"config": config, "trained": trained, "sent": sent, "scheme": scheme, **answer}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == fp8.FP8_DTYPE else t


def layouts(config: dict) -> dict[str, RunnerLayout]:
    return {"target": RunnerLayout.target(config, torch.bfloat16),
            "draft": RunnerLayout.mtp_draft(config, torch.bfloat16)}


def test_sglang_serves_the_trainer_values_within_one_fp8_unit(case):
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
    from sglang.srt.utils.weight_checker_comparator import ComparableWeight

    config, trained, block = case["config"], case["trained"], list(case["scheme"].block)
    n = config["num_hidden_layers"]
    expected = {"target": served_tensors(trained.items(), layouts(config)["target"]),
                "draft": served_tensors(trained.items(), layouts(config)["draft"])}
    checked = 0
    for role, state in case["state"].items():
        for name, weight in state.items():
            if weight.dtype != fp8.FP8_DTYPE:
                continue
            scale = state[name + fp8.SCALE_SUFFIX]
            assert scale.dtype == torch.float32, name
            served = block_quant_dequant(weight, scale, block, torch.float32)
            unit = block_quant_dequant(ComparableWeight._quant_ulp(weight), scale, block, torch.float32)
            want = expected[role][name].float()  # the trainer's values, fused as SGLang fuses them
            assert served.shape == want.shape, name
            assert ((served - want).abs() <= unit).all(), f"{role}:{name}"
            checked += 1
    # 2 target layers and the draft's MTP layer: fused MLA down projection, q_b, kv_b, o each; layer 0's dense
    # gate_up and down; layer 1's and the MTP layer's w13, w2 and shared gate_up and down
    assert n == 2 and checked == 3 * 4 + 2 + 2 * 4
    assert case["state"]["target"]["model.layers.1.mlp.experts.w13_weight"].dtype == fp8.FP8_DTYPE


@pytest.mark.parametrize("role", ["target", "draft"])
def test_served_layout_equals_sglang_fp8_parameters(case, role):
    theirs = {n: t for n, t in case["state"][role].items() if not n.endswith((*SKIPPED_BY_SGLANG, *KV_CACHE_SCALES))}
    mine = served_tensors(case["sent"], layouts(case["config"])[role])
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(bits(mine[name]), bits(tensor)), f"{role}:{name}"
    kv_scales = [t for n, t in case["state"][role].items() if n.endswith(KV_CACHE_SCALES)]
    assert kv_scales and all(float(t) == -1.0 for t in kv_scales)  # SGLang's placeholder: nothing writes them


def test_trainer_checksums_equal_sglang_weight_checker_on_fp8(case):
    recorder = ServedChecksums(layouts(case["config"]))
    for name, tensor in case["sent"]:
        recorder.add(name, tensor)
    assert not recorder.incomplete()
    mine = recorder.payload_keys()
    theirs = case["payload"]["checksums"]
    assert not any(n.endswith((fp8.SCALE_SUFFIX, *KV_CACHE_SCALES)) for n in theirs)  # a scale goes with its weight;
    # the KV-cache scales are marked `_skip_weight_check`
    assert sorted(mine) == sorted(theirs)
    assert {n: (mine[n], theirs[n]) for n in theirs if mine[n] != theirs[n]} == {}


def test_coverage_of_an_fp8_engine(case):
    served = verify.served_by_role({"ranks": [case["payload"]]})
    sent = {n for n, _ in case["sent"]}
    assert verify.check_coverage(served, sent, {"target", "draft"}).ok
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    missing = verify.check_coverage(served, sent - {name}, {"target"}).missing["target"]
    assert missing == ["model.layers.1.mlp.experts.w2_weight"]
