"""What our weight sync sends for DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash, loaded by SGLang 0.5.23's own model classes
on CPU.

Tiny checkpoints from make-tiny-model in each family's released layout (a dense layer, a sparse one with routed and
shared experts and the router's correction bias, one MTP layer at `model.layers.{num_hidden_layers}`) go to their
Megatron form, are moved (a training step's worth, so nothing can pass on the checkpoint's values) and are sent back
through the sync's own Megatron -> HF path (`gather.iter_hf_tensors`). Their Megatron form is the trainer's own model
(megatron-core's GPTModel with its MTP block, DeepSeek-V3's with multi-latent attention, loaded from the checkpoint).
SGLang builds its
target runner's `DeepseekV3ForCausalLM` / `Glm4MoeForCausalLM` / `Glm4MoeLiteForCausalLM` and its draft runner's
`DeepseekV3ForCausalLMNextN` / `Glm4MoeForCausalLMNextN` / `Glm4MoeLiteForCausalLMNextN` (the embedding and head
shared from the target, as the EAGLE worker does) in a process of
its own (sglang_models.py), each loads the tensors with its own `load_weights`, and SGLang's WeightChecker answers
`/weights_checker`. Then, name for name and by value:

- every SGLang parameter holds what we sent: DeepSeek-V3's and GLM-4.7-Flash's `q_a_proj` / `kv_a_proj_with_mqa`
  stacked into `fused_qkv_a_proj_with_mqa`, the other MLA tensors as sent; GLM-4.5's q/k/v and their biases stacked into
  `qkv_proj`; routed experts in FusedMoE's `w13_weight` / `w2_weight`; shared experts' gate/up in `gate_up_proj`;
  the router's correction bias (and GLM's router weight) in float32; the MTP layer in the draft only;
- our model of the served layout (`sglang_params.served_tensors`) equals SGLang's parameters, our checksums
  (`ServedChecksums`, what --check-weight-sync compares) equal SGLang's WeightChecker's, and the coverage check finds
  every served name written.

All four classes build and load on CPU with the stand-ins every conformance job uses (sglang_models.py), and one
more: their `set_embed_and_head` ends with `torch.cuda.synchronize()` (MiMoMTP's goes through the platform), which a
torch without CUDA refuses, so it is a no-op while the draft takes the target's embedding and head. DeepSeek-V3's MLA
needs YaRN rope scaling on CPU (SGLang's CPU rotary path serves `deepseek_yarn` only), which the released config has
and the tiny checkpoint keeps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slime_spec.weight_sync.verify import coverage as verify
from slime_spec.weight_sync.verify.sglang_params import RunnerLayout, ServedChecksums
from tests.conformance.sglang_models import answers_in_own_process, assert_served_equals_sglang

CASES = {"deepseek_v3": dict(dtype="bfloat16", seed=41), "glm4_moe": dict(dtype="bfloat16", seed=42),
         "glm4_moe_lite": dict(dtype="bfloat16", seed=43)}
MLA = ("deepseek_v3", "glm4_moe_lite")


def megatron_weights(checkpoint: Path, config: dict) -> list[tuple[str, torch.Tensor]]:
    """The trainer's model's weights where it builds the family (GLM-4.5, DeepSeek-V3), else the conversion's
    state dict."""
    from safetensors.torch import load_file

    from slime_spec.common.model_families import FAMILIES
    from slime_spec.config.run_config import TrainConfig
    from slime_spec.trainer import model as M
    from slime_spec.trainer import parallel
    from slime_spec.weight_sync import convert
    family = convert.family_of(config)
    if family not in FAMILIES:
        return list(convert.hf_to_megatron(family, load_file(str(checkpoint / "model.safetensors")), config).items())
    parallel.init_single_process(seed=0)
    model = M.build_gpt_model(config, TrainConfig(hf_checkpoint=str(checkpoint), mtp_num_layers=1))
    M.load_hf_weights(model, M.read_hf_state(checkpoint), config, tp_rank=0, tp_size=1)
    return [(n, t.detach()) for n, t in M.named_weights(model)]  # the router's expert bias included


def sync_sends(checkpoint: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's Megatron form, moved, through the sync's Megatron -> HF path (TP 1)."""
    from slime_spec.weight_sync.gather import iter_hf_tensors
    config = json.loads((checkpoint / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    moved = [(n, t.float() + 0.01 * torch.randn(t.shape, generator=gen))
             for n, t in megatron_weights(checkpoint, config)]
    return [(t.name, t.tensor.clone()) for t in iter_hf_tensors(moved, config)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from safetensors.torch import save_file

    from slime_spec.tools.tiny_model import make_tiny_model
    tmp = tmp_path_factory.mktemp("sglang_mla_moe")
    jobs, out = [], {}
    for arch, c in CASES.items():
        path = make_tiny_model(tmp / arch, arch=arch, mtp_layers=1, seed=c["seed"], dtype=c["dtype"])
        sent = sync_sends(path, c["seed"])
        save_file({n: t.contiguous() for n, t in sent}, str(tmp / f"{arch}.sent.safetensors"))
        jobs.append(dict(arch=arch, weights=str(tmp / f"{arch}.sent.safetensors"), config=str(path / "config.json"),
                         dtype=c["dtype"]))
        out[arch] = {"sent": sent, "config": json.loads((path / "config.json").read_text()),
                     "dtype": getattr(torch, c["dtype"])}
    for arch, answer in zip(CASES, answers_in_own_process(jobs, tmp)):
        out[arch].update(answer)
    return out


def layouts(case: dict) -> dict[str, RunnerLayout]:
    return {"target": RunnerLayout.target(case["config"], case["dtype"]),
            "draft": RunnerLayout.mtp_draft(case["config"], case["dtype"])}


@pytest.mark.parametrize("arch", CASES)
def test_sglang_target_loads_what_the_sync_sends(cases, arch):
    c = cases[arch]
    config, theirs, dtype = c["config"], c["state"]["target"], c["dtype"]
    sent = dict(c["sent"])
    n_layers, dense = config["num_hidden_layers"], config["first_k_dense_replace"]
    assert not any(n.startswith(f"model.layers.{n_layers}.") for n in theirs)  # the MTP layer is the draft's
    for i in range(n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if arch in MLA:
            fused = torch.cat([sent[a + "q_a_proj.weight"], sent[a + "kv_a_proj_with_mqa.weight"]])
            assert torch.equal(theirs[a + "fused_qkv_a_proj_with_mqa.weight"], fused.to(dtype))
            for name in ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj", "o_proj"):
                assert torch.equal(theirs[f"{a}{name}.weight"], sent[f"{a}{name}.weight"].to(dtype)), a + name
        else:
            for kind in ("weight", "bias"):
                assert torch.equal(theirs[f"{a}qkv_proj.{kind}"],
                                   torch.cat([sent[f"{a}{x}_proj.{kind}"] for x in "qkv"]).to(dtype))
        if i < dense:
            assert torch.equal(theirs[p + "mlp.gate_up_proj.weight"],
                               torch.cat([sent[p + "mlp.gate_proj.weight"], sent[p + "mlp.up_proj.weight"]]).to(dtype))
            continue
        bias = theirs[p + "mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and torch.equal(bias, sent[p + "mlp.gate.e_score_correction_bias"].float())
        router = theirs[p + "mlp.gate.weight"]
        assert router.dtype == (dtype if arch == "deepseek_v3" else torch.float32)  # GLM's routers: float32
        assert torch.equal(router, sent[p + "mlp.gate.weight"].to(router.dtype))
        w13, w2 = theirs[p + "mlp.experts.w13_weight"], theirs[p + "mlp.experts.w2_weight"]
        assert w13.shape[0] == w2.shape[0] == config["n_routed_experts"]
        for e in range(config["n_routed_experts"]):
            x = f"{p}mlp.experts.{e}."
            assert torch.equal(w13[e], torch.cat([sent[x + "gate_proj.weight"], sent[x + "up_proj.weight"]]).to(dtype))
            assert torch.equal(w2[e], sent[x + "down_proj.weight"].to(dtype))
        s = p + "mlp.shared_experts."
        assert torch.equal(theirs[s + "gate_up_proj.weight"],
                           torch.cat([sent[s + "gate_proj.weight"], sent[s + "up_proj.weight"]]).to(dtype))
    vocab = config["vocab_size"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(theirs[name][:vocab], sent[name].to(dtype)) and not theirs[name][vocab:].any()


@pytest.mark.parametrize("arch", CASES)
def test_sglang_nextn_draft_loads_the_mtp_layer(cases, arch):
    c = cases[arch]
    theirs, dtype, n = c["state"]["draft"], c["dtype"], c["config"]["num_hidden_layers"]
    sent = dict(c["sent"])
    for own in ("enorm", "hnorm", "eh_proj", "shared_head.norm"):
        assert torch.equal(theirs[f"model.{own}.weight"], sent[f"model.layers.{n}.{own}.weight"].to(dtype)), own
    p, d = f"model.layers.{n}.", "model.decoder."
    assert torch.equal(theirs[d + "mlp.experts.w2_weight"][0], sent[p + "mlp.experts.0.down_proj.weight"].to(dtype))
    assert torch.equal(theirs[d + "post_attention_layernorm.weight"],
                       sent[p + "post_attention_layernorm.weight"].to(dtype))
    # the embedding and head are the target's (set_embed_and_head), not the MTP layer's copies (not sent)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(theirs[name], c["state"]["target"][name])
    assert f"{p}embed_tokens.weight" not in sent and f"{p}shared_head.head.weight" not in sent


@pytest.mark.parametrize("arch", CASES)
def test_served_layout_equals_sglang_parameters_by_value(cases, arch):
    c = cases[arch]
    assert_served_equals_sglang(c, layouts(c))


@pytest.mark.parametrize("arch", CASES)
def test_trainer_checksums_equal_sglang_weight_checker(cases, arch):
    c = cases[arch]
    recorder = ServedChecksums(layouts(c))
    for name, tensor in c["sent"]:
        recorder.add(name, tensor)
    assert not recorder.incomplete()
    mine = recorder.payload_keys()
    theirs = c["payload"]["checksums"]
    assert sorted(mine) == sorted(theirs)
    assert {n: (mine[n], theirs[n]) for n in theirs if mine[n] != theirs[n]} == {}
    assert {info["role"] for info in c["payload"]["parallelism_info"]} == {"target", "draft"}


@pytest.mark.parametrize("arch", CASES)
def test_sync_coverage_of_sglang_served_names(cases, arch):
    """The coverage check over SGLang's fused MLA and MoE names: a correct sync is complete; a missing MLA half or
    expert is reported under the fused name it belongs to."""
    c = cases[arch]
    served = verify.served_by_role({"ranks": [c["payload"]]})
    sent = {n for n, _ in c["sent"]}
    assert verify.check_coverage(served, sent, {"target", "draft"}).ok
    left_out = {"model.layers.1.mlp.experts.2.up_proj.weight": "model.layers.1.mlp.experts.w13_weight"}
    if arch in MLA:
        left_out["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] = \
            "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"
    for name, fused in left_out.items():
        assert verify.check_coverage(served, sent - {name}, {"target"}).missing["target"] == [fused]
