"""Block-wise FP8 (DeepSeek-V3's checkpoint format): the quantizer the sync uses, checked by SGLang's own dequantizer;
which names are quantized; the pairing of a weight with its scale on the wire and on the embedded engine; a tiny FP8
checkpoint read by the trainer and the engine. SGLang's FP8 model classes loading what the sync sends:
tests/conformance/test_model_load_fp8.py."""

from __future__ import annotations

import json

import pytest
import torch

from slime_spec.weight_sync import fp8
from slime_spec.weight_sync.gather import NamedTensor, make_buckets, quantized

SCHEME = fp8.Fp8BlockScheme.from_hf_config({"quantization_config": fp8.DEEPSEEK_V3_FP8})


def test_quantized_values_are_the_originals_within_one_fp8_unit_by_sglangs_dequantizer():
    from slime_spec.engine import sglang_stand_ins
    sglang_stand_ins.install()
    from sglang.srt.utils.weight_checker_comparator import ComparableWeight

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen) * torch.logspace(-4, 1, 200)  # edge blocks, several magnitudes
    w[:128, :128] = 0  # an all-zero block
    q, s = fp8.quantize(w, SCHEME.block)
    assert q.dtype == fp8.FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (3, 2) == SCHEME.scale_shape(w.shape)
    assert s[0, 0] == 1.0  # any scale serves an all-zero block; 1 avoids 0 / 0
    served = fp8.dequantize(q, s, SCHEME.block, torch.float32)
    unit = fp8.dequantize(ComparableWeight._quant_ulp(q), s, SCHEME.block, torch.float32)
    assert ((served - w).abs() <= unit).all()
    assert torch.equal(served[:128, :128], w[:128, :128])
    # each block's largest magnitude maps onto FP8's largest value, so no block is clipped
    assert torch.allclose(q.float().abs().amax(), torch.tensor(fp8.FP8_MAX))


@pytest.mark.parametrize("name, quantized", [
    ("model.layers.0.self_attn.q_a_proj.weight", True),
    ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", True),
    ("model.layers.3.mlp.experts.7.down_proj.weight", True),
    ("model.layers.3.mlp.shared_experts.gate_proj.weight", True),
    ("model.layers.61.self_attn.o_proj.weight", True),  # the MTP layer's decoder, as the release has it
    ("model.layers.61.eh_proj.weight", False),
    ("model.layers.3.mlp.gate.weight", False),  # the router
    ("model.layers.0.self_attn.kv_a_layernorm.weight", False),
    ("model.embed_tokens.weight", False),
    ("lm_head.weight", False),
])
def test_which_weights_deepseek_v3_fp8_quantizes(name, quantized):
    assert SCHEME.quantizes(name) is quantized


def test_ignored_layers_stay_unquantized():
    scheme = fp8.Fp8BlockScheme.from_hf_config({"quantization_config": {
        **fp8.DEEPSEEK_V3_FP8, "modules_to_not_convert": ["model.layers.0.self_attn"]}})
    assert not scheme.quantizes("model.layers.0.self_attn.o_proj.weight")
    assert scheme.quantizes("model.layers.1.self_attn.o_proj.weight")


@pytest.mark.parametrize("config, field", [
    ({"quant_method": "awq"}, "quant_method is 'awq'"),
    ({**fp8.DEEPSEEK_V3_FP8, "activation_scheme": "static"}, "activation_scheme is 'static'"),
    ({**fp8.DEEPSEEK_V3_FP8, "scale_fmt": "ue8m0"}, "scale_fmt is 'ue8m0'"),
    ({**fp8.DEEPSEEK_V3_FP8, "weight_block_size": None}, "weight_block_size is None"),
])
def test_a_quantization_the_sync_does_not_reproduce_is_named(config, field):
    with pytest.raises(fp8.Fp8ConfigError, match=field):
        fp8.Fp8BlockScheme.from_hf_config({"quantization_config": config})
    assert fp8.Fp8BlockScheme.from_hf_config({}) is None


def test_each_weight_travels_with_its_scale_and_a_fused_pair_with_both():
    a = "model.layers.0.self_attn."
    stream = [NamedTensor(a + "q_a_proj.weight", torch.randn(128, 128)),
              NamedTensor(a + "q_a_layernorm.weight", torch.ones(128)),
              NamedTensor(a + "kv_a_proj_with_mqa.weight", torch.randn(64, 128)),
              NamedTensor(a + "o_proj.weight", torch.randn(128, 128)),
              NamedTensor("model.norm.weight", torch.ones(128))]
    sent = list(quantized(stream, SCHEME))
    assert [t.name for t in sent] == [
        a + "q_a_proj.weight", a + "q_a_proj.weight_scale_inv", a + "q_a_layernorm.weight",
        a + "kv_a_proj_with_mqa.weight", a + "kv_a_proj_with_mqa.weight_scale_inv", a + "o_proj.weight",
        a + "o_proj.weight_scale_inv", "model.norm.weight"]
    buckets = [b.names for b in make_buckets(sent, buffer_bytes=1)]  # every unit a bucket of its own
    assert buckets == [[a + "q_a_layernorm.weight"],
                       [a + "q_a_proj.weight", a + "q_a_proj.weight_scale_inv", a + "kv_a_proj_with_mqa.weight",
                        a + "kv_a_proj_with_mqa.weight_scale_inv"],
                       [a + "o_proj.weight", a + "o_proj.weight_scale_inv"], ["model.norm.weight"]]
    draft = NamedTensor(a + "o_proj.weight", torch.randn(128, 128), kind="draft")
    assert list(quantized([draft], SCHEME)) == [draft]  # a separate draft's own checkpoint is not FP8


def test_an_engine_holding_dequantized_weights_refuses_a_weight_without_its_scale():
    w = torch.randn(256, 128)
    q, s = fp8.quantize(w, SCHEME.block)
    name = "model.layers.0.mlp.down_proj.weight"
    (got,) = fp8.dequantize_pairs([(name, q), (name + fp8.SCALE_SUFFIX, s)], SCHEME)
    assert got[0] == name and torch.equal(got[1], fp8.dequantize(q, s, SCHEME.block, torch.float32))
    with pytest.raises(fp8.Fp8ConfigError, match=f"{name} is float8_e4m3fn with no {name}_scale_inv in the same"):
        fp8.dequantize_pairs([(name, q)], SCHEME)
    with pytest.raises(fp8.Fp8ConfigError, match="a block scale without its float8_e4m3fn weight"):
        fp8.dequantize_pairs([(name + fp8.SCALE_SUFFIX, s)], SCHEME)
    with pytest.raises(fp8.Fp8ConfigError, match=r"has shape \(1, 1\); blocks of \[128, 128\]"):
        fp8.dequantize_pairs([(name, q), (name + fp8.SCALE_SUFFIX, s[:1])], SCHEME)


def test_a_tiny_fp8_checkpoint_is_read_dequantized_by_the_trainer_and_the_engine(tmp_path):
    from safetensors.torch import load_file

    from slime_spec.engine.model_executor.model import load_model
    from slime_spec.tools.tiny_model import make_tiny_model
    from slime_spec.trainer.model import read_hf_state
    path = make_tiny_model(tmp_path / "m", arch="deepseek_v3", hidden_size=512, intermediate_size=256, fp8=True,
                           dtype="bfloat16", seed=5)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == fp8.DEEPSEEK_V3_FP8
    stored = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert stored[name].dtype == fp8.FP8_DTYPE and stored[name + fp8.SCALE_SUFFIX].dtype == torch.float32
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    values = read_hf_state(path)
    assert not any(n.endswith(fp8.SCALE_SUFFIX) for n in values)
    assert torch.equal(values[name], fp8.dequantize(stored[name], stored[name + fp8.SCALE_SUFFIX], SCHEME.block,
                                                    torch.float32))
    model, _ = load_model(path, dtype="float32")
    served = dict(model.named_parameters(remove_duplicate=False))
    attention = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(served[attention], values[attention])
    with pytest.raises(ValueError, match="64 in-features; SGLang's FP8 layers need multiples of 128"):
        make_tiny_model(tmp_path / "small", arch="deepseek_v3", hidden_size=64, fp8=True)


def test_fp8_weights_reach_sglang_through_a_flattened_tensor_bucket():
    """The tensor transport (colocated engines) sends each bucket flattened, as slime does: SGLang's own deserializer
    and FlattenedTensorBucket give the FP8 codes and scales back bit for bit. (Unflattened, a CPU float8 tensor is
    not readable by SGLang's SafeUnpickler: torch's weights-only loader has no float8 storage type.)"""
    import base64

    from slime_spec.engine import sglang_stand_ins
    from slime_spec.weight_sync.transports.tensor_payload import serialize_bucket, stage_bucket
    sglang_stand_ins.install()
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    q, s = fp8.quantize(torch.randn(256, 128), SCHEME.block)
    named = [("x.weight", q), ("x.weight_scale_inv", s), ("x.norm.weight", torch.ones(3, dtype=torch.bfloat16))]
    (entry,) = serialize_bucket(stage_bucket(named, flatten=True), flatten=True, count=1)
    payload = MultiprocessingSerializer.deserialize(base64.b64decode(entry))
    got = dict(FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"],
                                     metadata=payload["metadata"]).reconstruct_tensors())
    assert got["x.weight"].dtype == fp8.FP8_DTYPE
    assert torch.equal(got["x.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got["x.weight_scale_inv"], s) and torch.equal(got["x.norm.weight"], named[2][1])
