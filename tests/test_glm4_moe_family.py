"""GLM-4.5 in the trainer: megatron-core's own blocks (GQA with q/k/v bias and partial RoPE, dense layers before
`first_k_dense_replace`, then its MoE layer with sigmoid routing over the checkpoint's correction bias, a shared
expert, its MTP block) compute what transformers' Glm4MoeForCausalLM computes, train (forward and backward through
policy and MTP layer), and hand the weight sync every checkpoint tensor, the router's correction bias included."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.config.run_config import TrainConfig
from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.trainer import model as M
from tests.helpers.trainers import built_model, model_device


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("glm4_moe") / "m", arch="glm4_moe", num_layers=3, mtp_layers=1,
                           first_k_dense_replace=1, seed=7)



def test_trainer_is_megatrons_moe_and_equals_hf(glm):
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from transformers import AutoModelForCausalLM, Glm4MoeForCausalLM

    hf_config, model = built_model(glm)
    config = model.config
    assert config.moe_layer_freq == [0, 1, 1] and config.moe_router_score_function == "sigmoid"
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.0
    assert config.moe_router_topk_scaling_factor == hf_config["routed_scaling_factor"]
    assert config.moe_shared_expert_intermediate_size == hf_config["moe_intermediate_size"]
    assert config.add_qkv_bias and not config.qk_layernorm
    assert type(model.decoder.layers[0].mlp) is MLP and isinstance(model.decoder.layers[1].mlp, MoELayer)
    assert model.rotary_pos_emb.inv_freq.numel() == hf_config["head_dim"] // 4  # partial_rotary_factor 0.5
    bias = model.decoder.layers[2].mlp.router.expert_bias
    checkpoint = load_file(str(glm / "model.safetensors"))
    assert torch.equal(bias.cpu(), checkpoint["model.layers.2.mlp.gate.e_score_correction_bias"])
    ref = AutoModelForCausalLM.from_pretrained(glm, dtype=torch.float32)
    assert isinstance(ref, Glm4MoeForCausalLM)  # transformers has no MTP layer: model.layers.3 is left unread
    ids = torch.randint(0, hf_config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = M.forward(model.eval(), ids.to(model_device(model)), hf_config["vocab_size"]).logits.cpu()
        theirs = ref.eval()(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_forward_backward_with_mtp_and_sync_tensors(glm):
    from slime_spec.weight_sync.gather import iter_hf_tensors
    hf_config, model = built_model(glm, mtp_num_layers=1, enable_mtp_training=True)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(1))
    out = M.forward(model.train(), ids.to(model_device(model)), hf_config["vocab_size"])
    assert len(out.mtp_logits) == 1
    (out.logits.logsumexp(-1).mean() + out.mtp_logits[0].logsumexp(-1).mean()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()]
    assert missing == []
    sent = {t.name: t.tensor for t in iter_hf_tensors(M.named_weights(model), hf_config)}
    hf = load_file(str(glm / "model.safetensors"))
    # all but the MTP layer's embedding and head copies (Megatron's MTP, and SGLang's NextN, use the main ones)
    assert sorted(set(hf) - set(sent)) == ["model.layers.3.embed_tokens.weight",
                                           "model.layers.3.shared_head.head.weight"]
    assert set(sent) <= set(hf)
    assert all(torch.equal(sent[n].cpu(), hf[n].float()) for n in sent)


def test_bf16_keeps_the_correction_bias_in_float32(glm):
    """Under --bf16 the parameters are bfloat16, the routers' expert bias stays the checkpoint's float32 values (as
    megatron-core keeps it, and SGLang serves it)."""
    hf_config, model = built_model(glm, bf16=True)
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.dtype == torch.bfloat16
    checkpoint = load_file(str(glm / "model.safetensors"))
    for layer in (1, 2):
        bias = model.decoder.layers[layer].mlp.router.expert_bias
        assert bias.dtype == torch.float32
        assert torch.equal(bias.cpu(), checkpoint[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"])


def test_refusals(glm):
    hf_config = M.read_hf_config(glm)
    train = TrainConfig(hf_checkpoint=str(glm))
    with pytest.raises(ValueError, match="norm_topk_prob=false"):
        M.transformer_config({**hf_config, "norm_topk_prob": False}, train)
    with pytest.raises(ValueError, match="num_experts_per_tok=2, topk_group=2"):
        M.transformer_config({**hf_config, "n_group": 2, "topk_group": 2}, train)
    # under TP with sequence parallelism, its MTP layer too (tests/test_trainer_pp.py)
    assert M.transformer_config(hf_config, TrainConfig(hf_checkpoint=str(glm), tensor_model_parallel_size=2,
                                                       mtp_num_layers=1)).sequence_parallel
    with pytest.raises(ValueError, match="unsupported model: model_type='gpt2'"):
        M.transformer_config({"model_type": "gpt2"}, train)
