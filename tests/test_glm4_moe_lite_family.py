"""GLM-4.7-Flash (`glm4_moe_lite`, slime's run-glm4.7-30B-A3B.sh) is DeepSeek-V3's architecture with GLM's defaults:
multi-latent attention with plain RoPE, dense-first layers, sigmoid-routed experts over one group with a shared
expert, a NextN MTP layer. The trainer builds it from megatron-core's MLA and MoE blocks and computes what
transformers' Glm4MoeLiteForCausalLM computes, trains through policy and MTP layer, and hands the sync every
checkpoint tensor; the embedded engine computes the same logits, and NEXTN speculation with its MTP layer is lossless.
SGLang's own Glm4MoeLiteForCausalLM and its NextN draft load what the sync sends: tests/conformance/
test_model_load_mla_moe.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.engine.model_executor.mla import MLAttention
from slime_spec.engine.model_executor.model import NextNLayer, load_model
from slime_spec.engine.model_executor.moe import GroupedTopkMoeBlock
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.trainer import model as M
from tests.helpers.engine_runs import DEVICES, assert_logprobs_equal_a_full_forward, run_to_completion
from tests.helpers.engine_runs import assert_greedy_with_specs_equals_plain as assert_greedy_equals_plain
from tests.helpers.trainers import built_model, model_device

LAYERS = 3  # layer 0 dense, 1 and 2 sparse; the NextN layer is model.layers.3
PROMPTS = ["hello world", "the cat sat on the mat. the cat sat on the", "a", "1 2 3 4 5 6 7 8 1 2 3"]


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("glm4_moe_lite") / "m", arch="glm4_moe_lite", hidden_size=32,
                           num_layers=LAYERS, mtp_layers=1, first_k_dense_replace=1, seed=17)


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, Glm4MoeLiteForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert isinstance(ref, Glm4MoeLiteForCausalLM)  # transformers has no MTP layer: model.layers.3 is left unread
    with torch.no_grad():
        return ref.eval()(ids).logits



def test_trainer_is_megatrons_mla_and_moe_and_equals_hf(lite):
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    hf_config, model = built_model(lite)
    config = model.config
    assert config.multi_latent_attention and config.rope_type == "rope" and config.rotary_base == 1e6
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (
        hf_config["qk_nope_head_dim"], hf_config["qk_rope_head_dim"], hf_config["v_head_dim"])
    assert config.moe_layer_freq == [0, 1, 1] and config.moe_router_score_function == "sigmoid"
    assert config.moe_router_num_groups is None and config.moe_router_topk_scaling_factor == 1.8
    assert type(model.decoder.layers[0].self_attention) is MLASelfAttention
    assert type(model.decoder.layers[0].mlp) is MLP and isinstance(model.decoder.layers[1].mlp, MoELayer)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = M.forward(model.eval(), ids.to(model_device(model)), hf_config["vocab_size"]).logits.cpu()
    torch.testing.assert_close(ours, hf_logits(lite, ids), atol=1e-4, rtol=0)


def test_forward_backward_with_mtp_and_sync_tensors(lite):
    from slime_spec.weight_sync.gather import iter_hf_tensors
    hf_config, model = built_model(lite, mtp_num_layers=1, enable_mtp_training=True)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(1))
    out = M.forward(model.train(), ids.to(model_device(model)), hf_config["vocab_size"])
    (out.logits.logsumexp(-1).mean() + out.mtp_logits[0].logsumexp(-1).mean()).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()] == []
    sent = {t.name: t.tensor for t in iter_hf_tensors(M.named_weights(model), hf_config)}
    hf = load_file(str(lite / "model.safetensors"))
    # all but the MTP layer's embedding and head copies (Megatron's MTP, and SGLang's NextN, use the main ones)
    assert sorted(set(hf) - set(sent)) == [f"model.layers.{LAYERS}.embed_tokens.weight",
                                           f"model.layers.{LAYERS}.shared_head.head.weight"]
    assert set(sent) <= set(hf) and all(torch.equal(sent[n].cpu(), hf[n].float()) for n in sent)


def test_engine_equals_hf_full_and_cached(lite):
    model, _ = load_model(lite)
    a = model.args
    assert a.mla is not None and a.mla.yarn is None and a.mla.interleaved and a.grouped_topk and a.n_group == 1
    assert isinstance(model.model.layers[0].self_attn, MLAttention)
    assert all(isinstance(model.model.layers[i].mlp, GroupedTopkMoeBlock) for i in (1, 2))
    assert isinstance(model.model.layers[LAYERS], NextNLayer) and len(model.mtp_stack()) == 1
    ids = torch.randint(5, 100, (3, 21), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(21)[None].expand(3, 21)
    slots = torch.arange(3)
    full = model.logits(model(ids, positions, model.new_cache(3, 29), slots))
    cache = model.new_cache(3, 29)
    steps = [model.logits(model(ids[:, :10], positions[:, :10], cache, slots))]
    for t in range(10, 21):
        steps.append(model.logits(model(ids[:, t:t + 1], positions[:, t:t + 1], cache, slots)))
    ref = hf_logits(lite, ids)
    torch.testing.assert_close(full, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-5, rtol=0)


def requests(tok, temps=(0.0,), logprob=False):
    return [Request(f"r{i}", tok(t)["input_ids"], SamplingParams(temperature=temps[i % len(temps)], max_new_tokens=12,
                                                                 ignore_eos=True), return_logprob=logprob)
            for i, t in enumerate(PROMPTS)]


def test_greedy_with_nextn_speculation_equals_plain_decoding(lite):
    for outs in assert_greedy_equals_plain(lite, [SpecConfig("NEXTN", 3, 1, 4)], requests):
        assert sum(o.spec_draft_token_num for o in outs.values()) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_under_nextn_speculation_equal_a_full_forward(lite, device):
    engine = EngineCore(str(lite), SpecConfig("NEXTN", 3, 1, 4), max_running_requests=4, seed=3, device=device)
    reqs = requests(engine.tokenizer, temps=(0.0, 0.7), logprob=True)
    outs = run_to_completion(engine, reqs)
    assert sum(o.spec_verify_ct for o in outs.values()) > 0
    assert_logprobs_equal_a_full_forward(load_model(lite)[0], reqs, outs, device)
