"""What our weight sync sends for Qwen3 and Qwen3-MoE, loaded by SGLang 0.5.23's own `Qwen3ForCausalLM` and
`Qwen3MoeForCausalLM` `load_weights` on CPU.

The trainer builds its megatron-core GPTModel (qk_layernorm) from a tiny Qwen3 checkpoint, its weights are moved
(a training step's worth, so nothing can pass on the checkpoint's values), and the sync's own path
(`gather.iter_hf_tensors`: Megatron names -> HF names) produces the tensors sent. SGLang's model class is built
and loads them in a process of its own (sglang_models.py); then, name for name and by value:

- every SGLang parameter equals what we sent: q_norm / k_norm as sent, q/k/v stacked into `qkv_proj` and
  gate/up into `gate_up_proj` in SGLang's order, the embedding padded with zero rows;
- the trainer side's checksums (`sglang_params.ServedChecksums`, what --check-weight-sync compares) equal SGLang's
  WeightChecker's, and so do the embedded engine's after it loads the same tensors.

Two dense shapes: Qwen3-4B's (tied embedding, head_dim apart from hidden / heads) in float32, and Qwen3-8B's
(untied lm_head) in bfloat16; and Qwen3-MoE (Qwen3-30B-A3B's layout) in bfloat16, whose experts SGLang stacks into
its fused MoE's `w13_weight` / `w2_weight`. Qwen3-MoE's checksums are compared in test_weight_checker.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slime_spec.weight_sync.verify.sglang_params import RunnerLayout, ServedChecksums, served_tensors
from tests.conformance.sglang_models import answers_in_own_process

CASES = {"tied_fp32": dict(arch="qwen3", tie_word_embeddings=True, dtype="float32", seed=31),
         "untied_bf16": dict(arch="qwen3", tie_word_embeddings=False, dtype="bfloat16", seed=32),
         "moe_bf16": dict(arch="qwen3_moe", tie_word_embeddings=False, dtype="bfloat16", seed=33)}
DENSE = [name for name, c in CASES.items() if c["arch"] == "qwen3"]


def trainer_sends(checkpoint: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The trainer's model from the checkpoint, its weights moved, through the sync's Megatron -> HF path."""
    from slime_spec.config.run_config import TrainConfig
    from slime_spec.trainer import model as M
    from slime_spec.trainer import parallel
    from slime_spec.weight_sync.gather import iter_hf_tensors
    parallel.init_single_process(seed=0)
    hf_config = M.read_hf_config(checkpoint)
    model = M.build_gpt_model(hf_config, TrainConfig(hf_checkpoint=str(checkpoint)))
    M.load_hf_weights(model, M.read_hf_state(checkpoint), hf_config, tp_rank=0, tp_size=1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    return [(t.name, t.tensor.clone()) for t in iter_hf_tensors(model.named_parameters(), hf_config)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from safetensors.torch import save_file

    from slime_spec.tools.tiny_model import make_tiny_model
    tmp = tmp_path_factory.mktemp("sglang_qwen3")
    jobs, out = [], {}
    for name, c in CASES.items():
        path = make_tiny_model(tmp / name, arch=c["arch"], tie_word_embeddings=c["tie_word_embeddings"], seed=c["seed"])
        sent = trainer_sends(path, c["seed"])
        save_file({n: t.contiguous() for n, t in sent}, str(tmp / f"{name}.sent.safetensors"))
        jobs.append(dict(arch=c["arch"], weights=str(tmp / f"{name}.sent.safetensors"),
                         config=str(path / "config.json"), dtype=c["dtype"]))
        out[name] = {"sent": sent, "config": json.loads((path / "config.json").read_text()), "path": path,
                     "dtype": getattr(torch, c["dtype"])}
    for name, answer in zip(CASES, answers_in_own_process(jobs, tmp)):
        out[name].update(answer)
    return out


@pytest.mark.parametrize("case", DENSE)
def test_sglang_qwen3_loads_what_the_sync_sends(cases, case):
    c = cases[case]
    config, theirs = c["config"], c["state"]["target"]
    sent = dict(c["sent"])
    assert set(c["payload"]["checksums"]) == {n for n in theirs if not n.endswith("cos_sin_cache")}
    assert ("lm_head.weight" in sent) == (not config["tie_word_embeddings"])
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in ("q_norm", "k_norm"):  # megatron-core's q_layernorm / k_layernorm, one weight over head_dim
            name = f"{p}self_attn.{norm}.weight"
            assert torch.equal(theirs[name], sent[name].to(c["dtype"])), name
        qkv = theirs[f"{p}self_attn.qkv_proj.weight"]
        assert qkv.shape == (q + 2 * kv, config["hidden_size"])
        assert torch.equal(qkv, torch.cat([sent[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]).to(c["dtype"]))
        assert torch.equal(theirs[f"{p}mlp.gate_up_proj.weight"],
                           torch.cat([sent[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")]).to(c["dtype"]))
        assert f"{p}self_attn.qkv_proj.bias" not in theirs  # Qwen3: no qkv bias
    embed = theirs["model.embed_tokens.weight"]
    vocab = config["vocab_size"]
    assert torch.equal(embed[:vocab], sent["model.embed_tokens.weight"].to(c["dtype"])) and not embed[vocab:].any()
    # Every parameter, by the served layout our checksums model.
    mine = served_tensors(c["sent"], RunnerLayout.target(config, c["dtype"]))
    theirs = {n: t for n, t in theirs.items() if not n.endswith("cos_sin_cache")}
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name


@pytest.mark.parametrize("case", DENSE)
def test_trainer_and_engine_checksums_equal_sglang_weight_checker(cases, case):
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.engine.weights.checker import check_weights
    c = cases[case]
    recorder = ServedChecksums({"target": RunnerLayout.target(c["config"], c["dtype"])})
    for name, tensor in c["sent"]:
        recorder.add(name, tensor)
    assert not recorder.incomplete()
    assert recorder.checksums["target"] == c["payload"]["checksums"]
    core = EngineCore(str(c["path"]), None, dtype=str(c["dtype"]).removeprefix("torch."), max_running_requests=1)
    core.load_weights(c["sent"], selector="all")
    assert check_weights(core, {"action": "checksum", "selector": "all"}) == c["payload"]


def test_sglang_qwen3_moe_loads_what_the_sync_sends(cases):
    """Every parameter of SGLang's Qwen3-MoE from what we sent: the router as `mlp.gate`, expert e's gate/up as row
    block e of `experts.w13_weight` ([gate; up]), its down_proj as `experts.w2_weight[e]`."""
    c = cases["moe_bf16"]
    config, theirs, dtype = c["config"], c["state"]["target"], c["dtype"]
    sent = {n: t.to(dtype) for n, t in c["sent"]}
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        expected |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight",
                                     "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.qkv_proj.weight",
                                     "self_attn.o_proj.weight", "mlp.experts.w13_weight", "mlp.experts.w2_weight")}
        for n in ("input_layernorm", "post_attention_layernorm", "mlp.gate", "self_attn.q_norm", "self_attn.k_norm",
                  "self_attn.o_proj"):
            assert torch.equal(theirs[f"{p}{n}.weight"], sent[f"{p}{n}.weight"]), f"{p}{n}"
        assert torch.equal(theirs[f"{p}self_attn.qkv_proj.weight"],
                           torch.cat([sent[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]))
        w13, w2 = theirs[f"{p}mlp.experts.w13_weight"], theirs[f"{p}mlp.experts.w2_weight"]
        assert w13.shape[0] == w2.shape[0] == config["num_experts"]
        for e in range(config["num_experts"]):
            expert = f"{p}mlp.experts.{e}."
            assert torch.equal(w13[e], torch.cat([sent[expert + "gate_proj.weight"], sent[expert + "up_proj.weight"]]))
            assert torch.equal(w2[e], sent[expert + "down_proj.weight"])
    assert {n for n in theirs if not n.endswith("cos_sin_cache")} == expected
    vocab = config["vocab_size"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(theirs[name][:vocab], sent[name]) and not theirs[name][vocab:].any()
