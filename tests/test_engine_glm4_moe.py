"""GLM-4.5 on the embedded engine: the target computes what transformers' Glm4MoeForCausalLM computes (partial RoPE,
q/k/v bias, dense-first layers, grouped top-k MoE with a correction bias and a shared expert), its routing is SGLang's
biased_grouped_topk, its NextN MTP layer is SGLang's Glm4MoeModelNextN wiring, and NEXTN speculation is lossless."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.engine.model_executor.model import NextNLayer, load_model
from slime_spec.engine.model_executor.moe import GroupedTopkMoeBlock, grouped_topk_weights
from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.engine_runs import DEVICES, assert_logprobs_equal_a_full_forward, run_to_completion
from tests.helpers.engine_runs import assert_greedy_with_specs_equals_plain as assert_greedy_equals_plain
from tests.helpers.nextn_reference import nextn_logits

PROMPTS = ["hello world", "the cat sat on the mat. the cat sat on the", "a", "1 2 3 4 5 6 7 8 1 2 3",
           "abcabcabcabcabc", "xyz " * 8]
LAYERS = 3  # layer 0 dense, 1 and 2 sparse; the NextN layer is model.layers.3


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("glm4_moe") / "m", arch="glm4_moe", hidden_size=32,
                           num_layers=LAYERS, mtp_layers=1, first_k_dense_replace=1, seed=21)


def hf_model(path):
    from transformers import AutoModelForCausalLM, Glm4MoeForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert isinstance(model, Glm4MoeForCausalLM)
    return model.eval()


def ids_of(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(5, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_engine_equals_hf_full_and_cached(glm):
    model, _ = load_model(glm)
    a = model.args
    assert a.rotary_dim == a.head_dim // 2 and a.qkv_bias and not a.qk_norm and a.grouped_topk
    assert not isinstance(model.model.layers[0].mlp, GroupedTopkMoeBlock)
    assert all(isinstance(model.model.layers[i].mlp, GroupedTopkMoeBlock) for i in (1, 2))
    assert isinstance(model.model.layers[LAYERS], NextNLayer) and len(model.mtp_stack()) == 1
    ids = ids_of(3, 21)
    with torch.no_grad():
        ref = hf_model(glm)(ids).logits
    positions = torch.arange(21)[None].expand(3, 21)
    slots = torch.tensor([2, 0, 1])
    torch.testing.assert_close(model.logits(model(ids, positions, model.new_cache(3, 32), slots)), ref,
                               atol=1e-5, rtol=0)
    model.fuse_projections()  # experts' and the shared expert's gate/up fused as a dense MLP's
    cache = model.new_cache(3, 32)
    steps = [model.logits(model(ids[:, :12], positions[:, :12], cache, slots))]
    for t in range(12, 21):
        steps.append(model.logits(model(ids[:, t:t + 1], positions[:, t:t + 1], cache, slots)))
    torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-5, rtol=0)


def test_bf16_keeps_the_router_in_float32(glm):
    """SGLang's Glm4MoeGate holds the router weight and correction bias in float32 whatever the model's dtype."""
    model, _ = load_model(glm, dtype="bfloat16")
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts[0].up_proj.weight.dtype == torch.bfloat16
    checkpoint = load_file(str(glm / "model.safetensors"))
    assert torch.equal(gate.e_score_correction_bias, checkpoint["model.layers.1.mlp.gate.e_score_correction_bias"])
    ids = ids_of(2, 9)
    out = model.logits(model(ids, torch.arange(9)[None].expand(2, 9), model.new_cache(2, 16), torch.tensor([0, 1])))
    assert torch.isfinite(out).all()


def test_config_that_grouped_routing_cannot_serve_is_refused_by_name(glm):
    from slime_spec.engine.model_executor.model_args import ModelArgs
    config = json.loads((glm / "config.json").read_text())
    for bad in ({"n_group": 3}, {"topk_group": 2}, {"num_experts_per_tok": 5}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}={next(iter(bad.values()))}"):
            ModelArgs.from_hf_config({**config, **bad})


def sglang_biased_grouped_topk():
    """SGLang's biased_grouped_topk_impl as plain Python (it is wrapped in torch.compile, which only adds compile
    time on a CPU)."""
    from slime_spec.engine import sglang_stand_ins
    sglang_stand_ins.install()
    from sglang.srt.layers.moe.topk import biased_grouped_topk_impl

    return getattr(biased_grouped_topk_impl, "_torchdynamo_orig_callable", biased_grouped_topk_impl)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_routing_equals_sglang_and_transformers(glm, norm_topk_prob):
    """Several groups (GLM-4.5 ships one; DeepSeek-V3 eight): the experts chosen within the best `topk_group` groups
    by biased score, weighted by their unbiased scores, renormalized or not, times routed_scaling_factor."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    experts, k, groups, topk_group, scale = 16, 3, 4, 2, 2.5
    a = dataclasses.replace(load_model(glm)[0].args, num_experts=experts, num_experts_per_tok=k, n_group=groups,
                            topk_group=topk_group, routed_scaling_factor=scale, norm_topk_prob=norm_topk_prob)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(11, a.hidden_size, generator=gen)
    weight = torch.randn(experts, a.hidden_size, generator=gen)
    bias = 0.3 * torch.randn(experts, generator=gen)
    ours = grouped_topk_weights(torch.sigmoid(hidden @ weight.T), bias, a)
    assert ((ours > 0).sum(-1) == k).all()

    topk_weights, topk_ids = sglang_biased_grouped_topk()(hidden, hidden @ weight.T, bias, k, norm_topk_prob, groups,
                                                         topk_group, 0, scale, True)
    sglang = torch.zeros(11, experts).scatter(1, topk_ids.long(), topk_weights)
    torch.testing.assert_close(ours, sglang, atol=1e-6, rtol=0)

    config = Glm4MoeConfig(hidden_size=a.hidden_size, n_routed_experts=experts, num_experts_per_tok=k, n_group=groups,
                           topk_group=topk_group, routed_scaling_factor=scale, norm_topk_prob=norm_topk_prob)
    router = Glm4MoeTopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
    _, hf_weights, hf_ids = router(hidden)
    torch.testing.assert_close(ours, torch.zeros(11, experts).scatter(1, hf_ids, hf_weights), atol=1e-6, rtol=0)


def nextn_reference(path, ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """The NextN layer's logits by SGLang's Glm4MoeModelNextN wiring over transformers' own decoder layer:
    eh_proj(cat(enorm(embed(next token)), hnorm(target hidden))), the sparse decoder layer, shared_head.norm, and
    the target's lm_head (SGLang's NextN runner shares the target's embedding and head)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm

    return nextn_logits(hf_model(path), path, LAYERS, Glm4MoeDecoderLayer, Glm4MoeRMSNorm, ids, next_ids)


def test_nextn_layer_is_sglangs_wiring(glm):
    model, _ = load_model(glm)
    ids = ids_of(2, 15)
    next_ids = ids_of(2, 15, seed=2)
    positions = torch.arange(15)[None].expand(2, 15)
    slots = torch.tensor([0, 1])
    with torch.no_grad():
        hidden = model(ids, positions, model.new_cache(2, 32), slots)
        ours = model.logits(model.mtp_forward(next_ids, hidden, positions, model.new_mtp_cache(2, 32), slots))
    torch.testing.assert_close(ours, nextn_reference(glm, ids, next_ids), atol=1e-4, rtol=0)


def test_runners_split_target_and_nextn_weights(glm):
    """The target runner skips model.layers.{N} (SGLang's Glm4MoeForCausalLM loader does); the NextN runner loads it,
    minus the checkpoint's embedding and head copies, plus the target's embedding and lm_head."""
    engine = EngineCore(str(glm), SpecConfig("NEXTN", 2, 1, 3))
    target, draft = engine.named_weights("target"), engine.named_weights("draft")
    assert not any(n.startswith(f"model.layers.{LAYERS}.") for n in target)
    nextn = {n for n in draft if n.startswith(f"model.layers.{LAYERS}.")}
    assert {f"model.layers.{LAYERS}.{n}" for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                   "shared_head.norm.weight")} <= nextn
    assert set(draft) - nextn == {"model.embed_tokens.weight", "lm_head.weight"}
    assert not any(n.endswith(("shared_head.head.weight", f"{LAYERS}.embed_tokens.weight")) for n in draft)
    with pytest.raises(ValueError, match="selector='target'"):
        engine.load_weights([(f"model.layers.{LAYERS}.enorm.weight", torch.ones(32))], "target")
    engine.load_weights([(f"model.layers.{LAYERS}.enorm.weight", torch.full((32,), 2.0))], "draft")
    assert float(engine.named_weights("draft")[f"model.layers.{LAYERS}.enorm.weight"].min()) == 2.0


def requests(tok, temps=(0.0,), logprob=False):
    return [Request(f"r{i}", tok(t)["input_ids"], SamplingParams(temperature=temps[i % len(temps)], max_new_tokens=12,
                                                                 ignore_eos=True), return_logprob=logprob)
            for i, t in enumerate(PROMPTS)]


def test_greedy_with_nextn_speculation_equals_plain_decoding(glm):
    chain, tree = SpecConfig("NEXTN", 3, 1, 4), SpecConfig("EAGLE", 2, 3, 5)
    for outs in assert_greedy_equals_plain(glm, [chain, tree], requests):
        assert sum(o.spec_draft_token_num for o in outs.values()) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_under_nextn_speculation_equal_a_full_forward(glm, device):
    engine = EngineCore(str(glm), SpecConfig("NEXTN", 3, 1, 4), max_running_requests=4, seed=3, device=device)
    reqs = requests(engine.tokenizer, temps=(0.0, 0.7), logprob=True)
    outs = run_to_completion(engine, reqs)
    assert sum(o.spec_verify_ct for o in outs.values()) > 0
    assert_logprobs_equal_a_full_forward(load_model(glm)[0], reqs, outs, device)
