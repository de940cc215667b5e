"""DeepSeek-V3 on the embedded engine: the target computes what transformers' DeepseekV3ForCausalLM computes (MLA with
YaRN RoPE and its softmax mscale, dense-first layers, noaux_tc grouped top-k MoE with shared experts), its RoPE and
softmax scale are SGLang's DeepseekScalingRotaryEmbedding and compute_mla_mscale_scaling, its NextN MTP layer is
SGLang's DeepseekModelNextN wiring, and NEXTN speculation is lossless."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file, save_file

from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.engine.model_executor.mla import MLAttention
from slime_spec.engine.model_executor.model import NextNLayer, load_model
from slime_spec.engine.model_executor.model_args import ModelArgs
from slime_spec.engine.model_executor.moe import GroupedTopkMoeBlock
from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.engine_runs import DEVICES, assert_logprobs_equal_a_full_forward, run_to_completion
from tests.helpers.engine_runs import assert_greedy_with_specs_equals_plain as assert_greedy_equals_plain
from tests.helpers.nextn_reference import nextn_logits

PROMPTS = ["hello world", "the cat sat on the mat. the cat sat on the", "a", "1 2 3 4 5 6 7 8 1 2 3",
           "abcabcabcabcabc", "xyz " * 8]
LAYERS = 3  # layer 0 dense, 1 and 2 sparse; the NextN layer is model.layers.3


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("deepseek_v3") / "m", arch="deepseek_v3", hidden_size=32,
                           num_layers=LAYERS, mtp_layers=1, first_k_dense_replace=1, seed=31)


def hf_model(path):
    from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert isinstance(model, DeepseekV3ForCausalLM)
    return model.eval()


def ids_of(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(5, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits_full_and_cached(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's logits over `ids` in one prefill, and as a prefill of half then one token per step."""
    B, T = ids.shape
    positions = torch.arange(T)[None].expand(B, T)
    slots = torch.arange(B).flip(0)
    full = model.logits(model(ids, positions, model.new_cache(B, T + 8), slots))
    cache = model.new_cache(B, T + 8)
    steps = [model.logits(model(ids[:, :T // 2], positions[:, :T // 2], cache, slots))]
    for t in range(T // 2, T):
        steps.append(model.logits(model(ids[:, t:t + 1], positions[:, t:t + 1], cache, slots)))
    return full, torch.cat(steps, 1)


def test_engine_equals_hf_full_and_cached(ds):
    model, _ = load_model(ds)
    a = model.args
    assert a.mla is not None and a.mla.yarn is not None and a.mla.interleaved and a.grouped_topk
    assert a.num_kv_heads == a.num_heads and a.head_dim == a.mla.qk_head_dim
    assert isinstance(model.model.layers[0].self_attn, MLAttention)
    assert not isinstance(model.model.layers[0].mlp, GroupedTopkMoeBlock)
    assert all(isinstance(model.model.layers[i].mlp, GroupedTopkMoeBlock) for i in (1, 2))
    assert isinstance(model.model.layers[LAYERS], NextNLayer) and len(model.mtp_stack()) == 1
    ids = ids_of(3, 21)
    with torch.no_grad():
        ref = hf_model(ds)(ids).logits
    for fused in (False, True):  # fused: q_a_proj + kv_a_proj_with_mqa and every gate/up as one matmul each
        if fused:
            model.fuse_projections()
            assert model.model.layers[0].self_attn.qkv_a is not None
        full, cached = logits_full_and_cached(model, ids)
        torch.testing.assert_close(full, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(cached, ref, atol=1e-5, rtol=0)


def reinit(model: torch.nn.Module, seed: int) -> None:
    """Weights with unit-size activations and decisive routing (no near-ties in the top-k)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5 * (4.0 if name.endswith(
                    "mlp.gate.weight") else 1.0))


def checkpoint_layout(state: dict[str, torch.Tensor], n_experts: int) -> dict[str, torch.Tensor]:
    """transformers' packed experts ([E, 2I, H] gate then up, [E, H, I]) as the released checkpoints name them."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e in range(n_experts):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = t[e].chunk(2)
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(n_experts):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return {n: t.contiguous() for n, t in out.items()}


VARIANTS = {
    # DeepSeek-V2-Lite's shape: one q_proj, no query LoRA
    "q_proj": dict(q_lora_rank=None),
    # values narrower than the un-rotated key part; cos/sin scaled (mscale != mscale_all_dim), 2 of 3 groups kept
    "yarn_mscale": dict(v_head_dim=12, n_routed_experts=6, n_group=3, topk_group=2,
                        rope_scaling={"type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                                      "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 64}),
    # plain RoPE over the halves of the rope dims (rope_interleave false, as SGLang's is_neox_style)
    "plain_rope": dict(rope_scaling=None, rope_interleave=False),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_mla_variants_equal_hf(tmp_path, variant):
    """Shapes the tiny checkpoint does not have, from transformers' own model with random weights, saved in the
    checkpoint's layout and served by the engine."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = dict(vocab_size=101, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                  n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attention_bias=False, rope_interleave=True, **{"topk_method": "noaux_tc", "scoring_func": "sigmoid"})
    config.update(VARIANTS[variant])
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**config)).eval()
    reinit(hf, seed=5)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"],
                                                      "model_type": "deepseek_v3", **config}))
    save_file(checkpoint_layout(hf.state_dict(), config["n_routed_experts"]), str(tmp_path / "model.safetensors"))
    model, _ = load_model(tmp_path)
    ids = ids_of(2, 17, seed=4)
    with torch.no_grad():
        ref = hf(ids).logits
    full, cached = logits_full_and_cached(model, ids)
    torch.testing.assert_close(full, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(cached, ref, atol=1e-5, rtol=0)


@contextmanager
def sglang_rope_module():
    """SGLang's rotary embedding module, imported with `vllm` absent (a test double: its fallback rotary kernel, which
    RotaryEmbedding picks on a device it does not know, is never called by `forward_native`)."""
    from slime_spec.engine import sglang_stand_ins
    sglang_stand_ins.install()
    finder = sglang_stand_ins.AbsentModuleFinder({"vllm"})
    sys.meta_path.insert(0, finder)
    try:
        from sglang.srt.configs.model_config import compute_mla_mscale_scaling
        from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding
        yield DeepseekScalingRotaryEmbedding, compute_mla_mscale_scaling
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] == "vllm"]:
            del sys.modules[name]


@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.5])
def test_rope_and_softmax_scale_are_sglangs(ds, mscale_all_dim):
    """q/k rotated by the engine equal SGLang's DeepseekScalingRotaryEmbedding.forward_native (non-neox: interleaved
    pairs) over the same positions, and the softmax scale is compute_mla_mscale_scaling's."""
    from slime_spec.engine.model_executor.mla import rotate
    config = json.loads((ds / "config.json").read_text())
    scaling = {**config["rope_scaling"], "mscale_all_dim": mscale_all_dim}
    a = ModelArgs.from_hf_config({**config, "rope_scaling": scaling}).mla
    rope = a.qk_rope_head_dim
    positions = torch.tensor([0, 1, 5, 63, 64, 255, 700])
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(len(positions), 4, rope, generator=gen), torch.randn(len(positions), 1, rope, generator=gen)
    with sglang_rope_module() as (Rope, mla_scaling):
        theirs = Rope(rope, rope, scaling["original_max_position_embeddings"], config["rope_theta"], False,
                      scaling["factor"], torch.float32, beta_fast=scaling["beta_fast"], beta_slow=scaling["beta_slow"],
                      mscale=scaling["mscale"], mscale_all_dim=mscale_all_dim, device="cpu")
        q_ref, k_ref = theirs.forward_native(positions, q.clone(), k.clone())
        scale_ref = mla_scaling({**scaling, "rope_type": "deepseek_yarn"}, a.qk_head_dim ** -0.5)
    cos, sin = a.cos_sin(positions[None], torch.float32)
    torch.testing.assert_close(rotate(q[None], cos, sin, True)[0], q_ref.view_as(q), atol=1e-6, rtol=0)
    torch.testing.assert_close(rotate(k[None], cos, sin, True)[0], k_ref.view_as(k), atol=1e-6, rtol=0)
    assert a.softmax_scale == pytest.approx(scale_ref, rel=1e-12) and a.softmax_scale != a.qk_head_dim ** -0.5


def test_bf16_keeps_the_correction_bias_in_float32(ds):
    """SGLang's MoEGate holds DeepSeek-V3's correction bias in float32 and its router weight in the model's dtype."""
    model, _ = load_model(ds, dtype="bfloat16")
    gate = model.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32 and gate.weight.dtype == torch.bfloat16
    checkpoint = load_file(str(ds / "model.safetensors"))
    assert torch.equal(gate.e_score_correction_bias, checkpoint["model.layers.1.mlp.gate.e_score_correction_bias"])
    ids = ids_of(2, 9)
    out = model.logits(model(ids, torch.arange(9)[None].expand(2, 9), model.new_cache(2, 16), torch.tensor([0, 1])))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("bad, match", [
    ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    ({"qk_rope_head_dim": 3}, "qk_rope_head_dim=3"),
])
def test_config_the_engine_cannot_serve_is_refused_by_name(ds, bad, match):
    config = json.loads((ds / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_hf_config({**config, **bad})


def nextn_reference(path, ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """The NextN layer's logits by SGLang's DeepseekModelNextN wiring over transformers' own decoder layer:
    eh_proj(cat(enorm(embed(next token)), hnorm(target hidden))), the sparse decoder layer, shared_head.norm, and
    the target's lm_head (SGLang's NextN runner shares the target's embedding and head)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    return nextn_logits(hf_model(path), path, LAYERS, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, ids, next_ids,
                        causal_mask=True)


def test_nextn_layer_is_sglangs_wiring(ds):
    model, _ = load_model(ds)
    ids = ids_of(2, 15)
    next_ids = ids_of(2, 15, seed=2)
    positions = torch.arange(15)[None].expand(2, 15)
    slots = torch.tensor([0, 1])
    with torch.no_grad():
        hidden = model(ids, positions, model.new_cache(2, 32), slots)
        ours = model.logits(model.mtp_forward(next_ids, hidden, positions, model.new_mtp_cache(2, 32), slots))
    torch.testing.assert_close(ours, nextn_reference(ds, ids, next_ids), atol=1e-4, rtol=0)


def test_runners_split_target_and_nextn_weights(ds):
    """The target runner skips model.layers.{N} (SGLang's DeepseekV3ForCausalLM loader does); the NextN runner loads
    it, MLA and experts included, minus the checkpoint's embedding and head copies, plus the target's."""
    engine = EngineCore(str(ds), SpecConfig("NEXTN", 2, 1, 3))
    target, draft = engine.named_weights("target"), engine.named_weights("draft")
    assert not any(n.startswith(f"model.layers.{LAYERS}.") for n in target)
    nextn = {n for n in draft if n.startswith(f"model.layers.{LAYERS}.")}
    assert {f"model.layers.{LAYERS}.{n}" for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                   "shared_head.norm.weight", "self_attn.kv_b_proj.weight",
                                                   "mlp.gate.e_score_correction_bias")} <= nextn
    assert set(draft) - nextn == {"model.embed_tokens.weight", "lm_head.weight"}
    assert not any(n.endswith(("shared_head.head.weight", f"{LAYERS}.embed_tokens.weight")) for n in draft)


def requests(tok, temps=(0.0,), logprob=False):
    return [Request(f"r{i}", tok(t)["input_ids"], SamplingParams(temperature=temps[i % len(temps)], max_new_tokens=12,
                                                                 ignore_eos=True), return_logprob=logprob)
            for i, t in enumerate(PROMPTS)]


def test_greedy_with_nextn_speculation_equals_plain_decoding(ds):
    chain, tree = SpecConfig("NEXTN", 3, 1, 4), SpecConfig("EAGLE", 2, 3, 5)
    for outs in assert_greedy_equals_plain(ds, [chain, tree], requests):
        assert sum(o.spec_draft_token_num for o in outs.values()) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_under_nextn_speculation_equal_a_full_forward(ds, device):
    engine = EngineCore(str(ds), SpecConfig("NEXTN", 3, 1, 4), max_running_requests=4, seed=3, device=device)
    reqs = requests(engine.tokenizer, temps=(0.0, 0.7), logprob=True)
    outs = run_to_completion(engine, reqs)
    assert sum(o.spec_verify_ct for o in outs.values()) > 0
    assert_logprobs_equal_a_full_forward(load_model(ds)[0], reqs, outs, device)


def test_speculative_sampling_follows_the_target_distribution(tmp_path):
    """Sampled tokens under NEXTN speculation with the NextN layer follow the plain sampler's distribution (a 16-token
    vocabulary, so the exact marginals of tokens 2 and 3 can be enumerated)."""
    from slime_spec.engine.model_executor.sampling import chi_square_pvalue
    from tests.helpers.spec_runs import exact_marginals
    path = make_tiny_model(tmp_path / "v16", arch="deepseek_v3", vocab_size=16, hidden_size=32, mtp_layers=1, seed=8)
    prompt, temperature, n = [5, 6, 7, 5, 6], 1.3, 2000
    engine = EngineCore(str(path), SpecConfig("NEXTN", 2, 1, 3), max_running_requests=64, seed=0)
    params = SamplingParams(temperature=temperature, max_new_tokens=3, ignore_eos=True)
    for i in range(n):
        engine.add_request(Request(str(i), prompt, params))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert sum(o.spec_accept_token_num for o in outs) > 0.05 * n  # drafts are accepted, and rejected
    assert sum(o.spec_accept_token_num for o in outs) < sum(o.spec_draft_token_num for o in outs)
    p2, p3 = exact_marginals(path, prompt, temperature)
    t2 = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=16)
    t3 = torch.bincount(torch.tensor([o.output_ids[2] for o in outs]), minlength=16)
    assert chi_square_pvalue(t2, p2) > 1e-3
    assert chi_square_pvalue(t3, p3) > 1e-3


def test_the_mla_cache_size_is_what_it_allocates(ds):
    """Values are v_head_dim wide under MLA: the size checked before allocating counts them as such."""
    model, _ = load_model(ds)
    cache = model.new_cache(3, 20)
    assert model.args.mla.v_head_dim != model.args.head_dim
    assert model.cache_bytes(3, 20) == sum(t.nbytes for t in cache.k + cache.v)
