"""Qwen3 dense end to end: the tiny checkpoint is Qwen3's HF layout, the trainer (megatron-core's qk_layernorm)
and the embedded engine compute what transformers' Qwen3 computes, speculation is lossless, TP 2 equals TP 1."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.config.run_config import TrainConfig
from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.engine.model_executor.model import load_model
from slime_spec.tools.tiny_model import main as make_tiny_model_cli
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.trainer import model as M
from slime_spec.trainer import parallel
from tests.helpers.engine_runs import (
    DEVICES,
    assert_greedy_speculation_equals_plain,
    assert_greedy_with_specs_equals_plain,
    assert_logprobs_equal_a_full_forward,
    run_to_completion,
)

PROMPTS = ["hello world", "the cat sat on the mat. the cat sat on the", "a", "1 2 3 4 5 6 7 8 1 2 3",
           "abcabcabcabcabc", "Q: why? A:", "xyz " * 8, "repeat repeat repeat repeat"]
# The keys of Qwen/Qwen3-4B's config.json (transformers_version left out).
QWEN3_4B_CONFIG_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim", "hidden_act",
    "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings", "max_window_layers",
    "model_type", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_scaling",
    "rope_theta", "sliding_window", "tie_word_embeddings", "torch_dtype", "use_cache", "use_sliding_window",
    "vocab_size"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    target = make_tiny_model(root / "target", arch="qwen3", hidden_size=32, num_layers=2, seed=21)
    draft = make_tiny_model(root / "draft", arch="qwen3", hidden_size=32, num_layers=1, seed=22, init_from=str(target))
    return {"target": target, "draft": draft}


def test_checkpoint_is_qwen3s_hf_layout(ckpts, tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    config = json.loads((ckpts["target"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["attention_bias"] is False and config["tie_word_embeddings"] is True
    assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]  # as Qwen3-4B: 32 x 128 vs 2560
    assert QWEN3_4B_CONFIG_KEYS <= set(config), QWEN3_4B_CONFIG_KEYS - set(config)
    model, info = AutoModelForCausalLM.from_pretrained(ckpts["target"], output_loading_info=True)
    assert isinstance(model, Qwen3ForCausalLM)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    weights = load_file(str(ckpts["target"] / "model.safetensors"))
    assert sorted(weights) == sorted(k for k in model.state_dict() if k != "lm_head.weight")  # tied
    assert weights["model.layers.1.self_attn.q_norm.weight"].shape == (config["head_dim"],)
    assert not any(k.endswith(".bias") for k in weights)
    # The CLI writes the same thing, and takes a head_dim of its own.
    assert make_tiny_model_cli(["--arch", "qwen3", "--head-dim", "24", "--out", str(tmp_path / "cli")]) == 0
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["head_dim"] == 24


def test_trainer_builds_megatrons_qk_layernorm_and_refuses_qkv_bias(ckpts):
    parallel.init_single_process(seed=0)
    hf_config = M.read_hf_config(ckpts["target"])
    train = TrainConfig(hf_checkpoint=str(ckpts["target"]))
    config = M.transformer_config(hf_config, train)
    assert config.qk_layernorm and config.kv_channels == hf_config["head_dim"] and not config.add_qkv_bias
    model = M.build_gpt_model(hf_config, train)
    attention = model.decoder.layers[0].self_attention
    assert type(attention.q_layernorm) is torch.nn.RMSNorm  # megatron-core's local spec (WrappedTorchNorm)
    assert attention.q_layernorm.weight.shape == (hf_config["head_dim"],)
    assert attention.q_layernorm.eps == hf_config["rms_norm_eps"]
    with pytest.raises(ValueError, match="attention_bias=true"):
        M.transformer_config({**hf_config, "attention_bias": True}, train)
    with pytest.raises(ValueError, match="no MTP layers"):
        M.transformer_config(hf_config, TrainConfig(hf_checkpoint=str(ckpts["target"]), mtp_num_layers=1))


def requests(tok, temps=(0.0,), logprob=False):
    return [Request(f"r{i}", tok(text)["input_ids"],
                    SamplingParams(temperature=temps[i % len(temps)], max_new_tokens=10 + 5 * (i % 4), ignore_eos=True),
                    return_logprob=logprob) for i, text in enumerate(PROMPTS)]


def test_greedy_with_speculation_equals_plain_decoding(ckpts):
    for engine in assert_greedy_speculation_equals_plain(ckpts["target"], ckpts["draft"], requests):
        assert engine.avg_spec_accept_length >= 1.0


def test_an_eagle3_draft_speculates_losslessly_on_a_qwen3_target(tmp_path):
    """`make-tiny-model --arch qwen3 --eagle3-draft`: a Llama-layout EAGLE3 draft over a Qwen3 target (head_dim twice
    hidden / heads, q/k norms) decodes greedily what plain decoding does."""
    target, draft = tmp_path / "t", tmp_path / "d"
    assert make_tiny_model_cli(["--arch", "qwen3", "--hidden-size", "32", "--num-layers", "4", "--seed", "23",
                                "--out", str(target), "--eagle3-draft", str(draft), "--draft-vocab", "40"]) == 0
    [outs] = assert_greedy_with_specs_equals_plain(target, [SpecConfig("EAGLE3", 3, 1, 4, str(draft))], requests)
    assert sum(o.spec_verify_ct for o in outs.values()) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_under_speculation_equal_a_full_forward(ckpts, device):
    """On CUDA the q/k norms run before the fused RoPE + attention kernel, and graphs replay (float32 here)."""
    engine = EngineCore(str(ckpts["target"]), SpecConfig("STANDALONE", 2, 1, 3, str(ckpts["draft"])),
                        max_running_requests=4, seed=3, device=device)
    outs = run_to_completion(engine, requests(engine.tokenizer, temps=(0.0, 0.7), logprob=True))
    plain_requests = requests(engine.tokenizer, temps=(0.0, 0.7))
    assert_logprobs_equal_a_full_forward(load_model(ckpts["target"])[0], plain_requests, outs, device)


def test_engine_refuses_qwen3_with_attention_bias(ckpts, tmp_path):
    from slime_spec.engine.model_executor.model import ModelArgs
    config = json.loads((ckpts["target"] / "config.json").read_text())
    assert ModelArgs.from_hf_config(config).qk_norm and not ModelArgs.from_hf_config(config).qkv_bias
    with pytest.raises(ValueError, match="attention_bias=true"):
        ModelArgs.from_hf_config({**config, "attention_bias": True})


@pytest.fixture(scope="module")
def ray_cluster():
    from tests.helpers.tp_runs import local_ray_cluster

    with local_ray_cluster():
        yield


def test_tp2_equals_tp1_and_syncs_into_the_engine(ray_cluster, tmp_path):
    """Each TP rank normalizes only its own heads with the whole q/k norm weight: their gradients are partial sums
    that must be added over the TP group (as Megatron's finalize_model_grads does), or the update differs."""
    from slime_spec.config.run_config import EngineConfig
    from slime_spec.fleet.process import engine_server_process
    from slime_spec.trainer.group import TrainGroup
    from slime_spec.trainer.trainer import Trainer
    from tests.helpers.tp_runs import assert_same_adam_step, tp2_config
    from tests.helpers.tp_runs import tp_rollout as rollout

    path = make_tiny_model(tmp_path / "m", arch="qwen3", seed=2)  # vocab 101: TP 2 pads it to 102
    kw = dict(hf_checkpoint=str(path), lr=1e-3, global_batch_size=4, micro_batch_size=2, n_samples_per_prompt=2,
              use_kl_loss=True, kl_loss_coef=0.1)
    ngram = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3}
    flags = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "3")
    engine = EngineConfig("embedded", str(path), forwarded_argv=flags, server_args=ngram)
    group = TrainGroup(tp2_config(path, engine, kw, tmp_path / "out"), use_gpu=False)
    server = engine_server_process(engine, log_path=tmp_path / "engine.log")
    try:
        parallel.init_single_process(seed=0)
        single = Trainer(TrainConfig(**kw))
        probe = [rollout()[0].tokens, rollout()[3].tokens]
        torch.testing.assert_close(group.forward_logits(probe)["logits"], single.forward_logits(probe)["logits"],
                                   atol=1e-5, rtol=0)
        hf = load_file(str(path / "model.safetensors"))
        gathered = group.hf_state_dict()
        assert sorted(gathered) == sorted(hf) and all(torch.equal(gathered[k], hf[k]) for k in hf)

        m2, m1 = group.train_step(rollout(), 0), single.train_step(rollout(), 0)
        for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
        after2, after1 = group.hf_state_dict(), single.hf_state_dict()
        q_norm = "model.layers.0.self_attn.q_norm.weight"
        assert not torch.equal(after1[q_norm], hf[q_norm])
        assert_same_adam_step(after2, after1, hf, kw["lr"])

        server.start(timeout_s=120)
        group.connect_engines([server.url])
        metrics = group.sync_weights("0", probe_samples=rollout())  # check_weight_sync: checksums compared
        assert metrics["weight_sync_params"] == len(hf)
    finally:
        group.shutdown()
        server.stop()
