"""Qwen3-MoE: the tiny checkpoint is Qwen3-MoE's HF layout (per-expert tensors, router `mlp.gate`), conversion both
ways with TP shards, the trainer (megatron-core's MoE layer: top-k router, token dispatcher, sequential experts) and
the embedded engine compute what transformers' Qwen3-MoE computes, and speculation is lossless."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.config.run_config import TrainConfig
from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.engine.model_executor.model import load_model
from slime_spec.tools.tiny_model import make_tiny_eagle3_draft, make_tiny_model
from slime_spec.trainer import model as M
from slime_spec.trainer import parallel
from slime_spec.weight_sync import convert
from tests.helpers.engine_runs import (
    DEVICES,
    assert_greedy_speculation_equals_plain,
    assert_greedy_with_specs_equals_plain,
    assert_logprobs_equal_a_full_forward,
    run_to_completion,
)

# The keys of Qwen/Qwen3-30B-A3B's config.json (transformers_version left out).
QWEN3_30B_A3B_CONFIG_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "bos_token_id", "decoder_sparse_step", "eos_token_id",
    "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings",
    "max_window_layers", "mlp_only_layers", "model_type", "moe_intermediate_size", "norm_topk_prob",
    "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
    "output_router_logits", "rms_norm_eps", "rope_scaling", "rope_theta", "router_aux_loss_coef", "sliding_window",
    "tie_word_embeddings", "torch_dtype", "use_cache", "use_sliding_window", "vocab_size"}
PROMPTS = ["hello world", "the cat sat on the mat. the cat sat on the", "a", "1 2 3 4 5 6 7 8 1 2 3",
           "abcabcabcabcabc", "xyz " * 8]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe")
    target = make_tiny_model(root / "target", arch="qwen3_moe", hidden_size=32, num_layers=2, seed=41)
    draft = make_tiny_model(root / "draft", arch="qwen3_moe", hidden_size=32, num_layers=1, seed=42,
                            init_from=str(target))
    return {"target": target, "draft": draft}


def hf_model(path):
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def test_checkpoint_is_qwen3_moes_hf_layout(ckpts):
    config = json.loads((ckpts["target"] / "config.json").read_text())
    assert QWEN3_30B_A3B_CONFIG_KEYS <= set(config), QWEN3_30B_A3B_CONFIG_KEYS - set(config)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["norm_topk_prob"] is True
    assert config["tie_word_embeddings"] is False and config["mlp_only_layers"] == []
    hf_model(ckpts["target"])
    weights = load_file(str(ckpts["target"] / "model.safetensors"))
    e, i = config["num_experts"], config["moe_intermediate_size"]
    assert weights["model.layers.1.mlp.gate.weight"].shape == (e, config["hidden_size"])
    assert weights[f"model.layers.1.mlp.experts.{e - 1}.down_proj.weight"].shape == (config["hidden_size"], i)
    assert not any(k.startswith("model.layers.0.mlp.gate_proj") for k in weights)


def test_conversion_round_trip_and_tp_shards(ckpts):
    config = json.loads((ckpts["target"] / "config.json").read_text())
    hf = load_file(str(ckpts["target"] / "model.safetensors"))
    megatron = convert.hf_to_megatron("qwen3_moe", hf, config)
    assert "decoder.layers.0.mlp.router.weight" in megatron
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in megatron
    back = {}
    for name, full in megatron.items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            full = torch.cat([full, torch.zeros(1, full.shape[1])])  # vocab 101 padded to a multiple of TP 2
        shards = [convert.split_tp_shard(name, full, r, 2) for r in range(2)]
        merged = convert.merge_tp_shards(name, shards)
        assert torch.equal(merged, full), name
        back.update(convert.megatron_to_hf("qwen3_moe", name, merged, config))
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    assert convert.tp_split_dim("decoder.layers.0.mlp.router.weight") is None


def test_trainer_is_megatrons_moe_layer_and_equals_hf(ckpts):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    parallel.init_single_process(seed=0)
    path = ckpts["target"]
    hf_config = M.read_hf_config(path)
    config = M.transformer_config(hf_config, TrainConfig(hf_checkpoint=str(path)))
    assert config.num_moe_experts == hf_config["num_experts"]
    assert config.moe_router_topk == hf_config["num_experts_per_tok"]
    assert config.moe_ffn_hidden_size == hf_config["moe_intermediate_size"] and not config.moe_router_pre_softmax
    assert config.qk_layernorm
    model = M.build_gpt_model(hf_config, TrainConfig(hf_checkpoint=str(path)))
    M.load_hf_weights(model, M.read_hf_state(path), hf_config, tp_rank=0, tp_size=1)
    mlp = model.decoder.layers[0].mlp
    assert isinstance(mlp, MoELayer) and isinstance(mlp.router, TopKRouter)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = M.forward(model.eval(), ids.to(model.embedding.word_embeddings.weight.device),
                         hf_config["vocab_size"]).logits.cpu()  # on CUDA: the all-to-all token dispatcher
        ref = hf_model(path)(ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        M.transformer_config({**hf_config, "mlp_only_layers": [0]}, TrainConfig(hf_checkpoint=str(path)))
    # megatron-core trains its MoE layer under TP only with sequence parallelism (tests/test_trainer_tp.py), an
    # online EAGLE3 draft beside it too
    assert M.transformer_config(hf_config, TrainConfig(hf_checkpoint=str(path), tensor_model_parallel_size=2,
                                                       enable_draft_training=True)).sequence_parallel


def test_without_norm_topk_prob_the_trainer_and_engine_equal_hf(tmp_path):
    """norm_topk_prob false: the top-k of the full softmax, not renormalized (megatron's pre-softmax routing)."""
    path = make_tiny_model(tmp_path / "m", arch="qwen3_moe", hidden_size=32, seed=5)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    parallel.init_single_process(seed=0)
    hf_config = M.read_hf_config(path)
    model = M.build_gpt_model(hf_config, TrainConfig(hf_checkpoint=str(path)))
    assert model.config.moe_router_pre_softmax
    M.load_hf_weights(model, M.read_hf_state(path), hf_config, tp_rank=0, tp_size=1)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    engine, _ = load_model(path)
    with torch.no_grad():
        ref = hf_model(path)(ids).logits
        ours = M.forward(model.eval(), ids.to(model.embedding.word_embeddings.weight.device),
                         hf_config["vocab_size"]).logits.cpu()
    served = engine.logits(engine(ids, torch.arange(13)[None].expand(2, 13), engine.new_cache(2, 16),
                                  torch.tensor([0, 1])))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(served, ref, atol=1e-5, rtol=0)


def test_engine_equals_hf_full_and_cached(ckpts):
    model, _ = load_model(ckpts["target"])
    ids = torch.randint(5, 100, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(ckpts["target"])(ids).logits
    positions = torch.arange(21)[None].expand(3, 21)
    slots = torch.tensor([2, 0, 1])
    torch.testing.assert_close(model.logits(model(ids, positions, model.new_cache(3, 32), slots)), ref,
                               atol=1e-5, rtol=0)
    model.fuse_projections()  # the experts' gate/up fused as a dense MLP's
    cache = model.new_cache(3, 32)
    steps = [model.logits(model(ids[:, :12], positions[:, :12], cache, slots))]
    for t in range(12, 21):
        steps.append(model.logits(model(ids[:, t:t + 1], positions[:, t:t + 1], cache, slots)))
    torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-5, rtol=0)


def test_greedy_with_speculation_equals_plain_decoding(ckpts):
    def requests(tok):
        return [Request(f"r{i}", tok(t)["input_ids"], SamplingParams(temperature=0.0, max_new_tokens=12,
                                                                     ignore_eos=True)) for i, t in enumerate(PROMPTS)]

    assert_greedy_speculation_equals_plain(ckpts["target"], ckpts["draft"], requests)


def test_an_eagle3_draft_speculates_losslessly_on_a_qwen3_moe_target(tmp_path):
    """The EAGLE3 seed's target family (Qwen3-235B-A22B): a Llama-layout EAGLE3 draft reads the MoE target's aux
    layers; greedy output equals plain decoding."""
    target = make_tiny_model(tmp_path / "t", arch="qwen3_moe", hidden_size=32, num_layers=4, seed=43)
    draft = make_tiny_eagle3_draft(tmp_path / "d", target, draft_vocab_size=40)

    def requests(tok):
        return [Request(f"r{i}", tok(t)["input_ids"], SamplingParams(temperature=0.0, max_new_tokens=12,
                                                                     ignore_eos=True)) for i, t in enumerate(PROMPTS)]

    [outs] = assert_greedy_with_specs_equals_plain(target, [SpecConfig("EAGLE3", 3, 1, 4, str(draft))], requests)
    assert sum(o.spec_verify_ct for o in outs.values()) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_under_speculation_equal_a_full_forward(ckpts, device):
    """On CUDA the routing runs inside captured graphs (static shapes: every expert weighted, zero where unpicked)."""
    engine = EngineCore(str(ckpts["target"]), SpecConfig("STANDALONE", 2, 1, 3, str(ckpts["draft"])),
                        max_running_requests=4, seed=3, device=device)
    requests = [Request(f"r{i}", engine.tokenizer(t)["input_ids"],
                        SamplingParams(temperature=(0.0, 0.7)[i % 2], max_new_tokens=10, ignore_eos=True),
                        return_logprob=True) for i, t in enumerate(PROMPTS)]
    outs = run_to_completion(engine, requests)
    assert_logprobs_equal_a_full_forward(load_model(ckpts["target"])[0], requests, outs, device)
