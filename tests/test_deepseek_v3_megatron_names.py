"""DeepSeek-V3's conversion against megatron-core 0.16.1's own modules: its MLA self-attention (local spec:
linear_q_down_proj, q_layernorm, linear_q_up_proj, linear_kv_down_proj, kv_layernorm, linear_kv_up_proj,
linear_proj), dense-first layers, MoE layers (router with expert bias, sequential experts, shared experts) and MTP
block are built, and every Megatron name and shape the conversion gives for a make-tiny-model checkpoint is one of
theirs, both ways.

The trainer does not build DeepSeek-V3: megatron-core 0.16.1 builds MLA only with TransformerEngine installed (its
local DotProductAttention takes no separate k / v head dims, which MLA passes; and without TransformerEngine MLA's
`isinstance(self.linear_proj, TELinear)` tests against None). Here the core attention is a test double holding no
parameters, and `TELinear` a class nothing is an instance of (what it means where TransformerEngine is absent), so
only the names and shapes are checked, no forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime_spec.tools.tiny_model import make_tiny_model
from slime_spec.trainer import model as M
from slime_spec.trainer import parallel
from slime_spec.weight_sync import convert
from slime_spec.weight_sync.gather import iter_hf_tensors


class CoreAttentionDouble(torch.nn.Module):
    """Stands in for megatron-core's core attention, which has no parameters (never called: no forward here)."""

    def __init__(self, **kwargs):
        super().__init__()


def megatron_deepseek_v3(hf: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    layers, dense = hf["num_hidden_layers"], hf["first_k_dense_replace"]
    rope = hf["rope_scaling"]
    config = MLATransformerConfig(
        num_layers=layers, hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"], normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, qk_layernorm=True, use_cpu_initialization=True,
        q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], rope_type="yarn",
        rotary_scaling_factor=rope["factor"], original_max_position_embeddings=rope["original_max_position_embeddings"],
        num_moe_experts=hf["n_routed_experts"], moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=hf["n_shared_experts"] * hf["moe_intermediate_size"],
        moe_layer_freq=[0] * dense + [1] * (layers - dense), moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, mtp_num_layers=1,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for spec in block.layer_specs:
        spec.submodules.self_attention.submodules.core_attention = CoreAttentionDouble
    M._define_te_general_gemm()
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=hf["vocab_size"],
                    max_sequence_length=hf["max_position_embeddings"], position_embedding_type="rope",
                    mtp_block_spec=get_gpt_mtp_block_spec(config, block, use_transformer_engine=False))


def test_conversion_names_and_shapes_are_megatron_cores(tmp_path, monkeypatch):
    from megatron.core.transformer import multi_latent_attention

    monkeypatch.setattr(multi_latent_attention, "TELinear", type("AbsentTELinear", (), {}))
    path = make_tiny_model(tmp_path / "ds", arch="deepseek_v3", num_layers=3, mtp_layers=1, seed=3)
    parallel.init_single_process(seed=0)
    hf_config, hf_state = M.read_hf_config(path), M.read_hf_state(path)
    model = megatron_deepseek_v3(hf_config)
    theirs = {n: tuple(t.shape) for n, t in M.named_weights(model)}
    ours = {n: tuple(t.shape) for n, t in convert.hf_to_megatron("deepseek_v3", hf_state, hf_config).items()}
    assert ours == theirs
    assert "decoder.layers.0.self_attention.linear_q_down_proj.weight" in theirs  # MLA, dense MLP first
    assert "decoder.layers.0.mlp.linear_fc1.weight" in theirs and "decoder.layers.1.mlp.router.expert_bias" in theirs
    assert "mtp.layers.0.transformer_layer.self_attention.kv_layernorm.weight" in theirs
    # loaded strictly by the trainer's loader, then the sync's path gives the checkpoint back (but the MTP layer's
    # embedding / head copies), by value
    M.load_hf_weights(model, hf_state, hf_config, tp_rank=0, tp_size=1)
    sent = {t.name: t.tensor for t in iter_hf_tensors(M.named_weights(model), hf_config)}
    assert sorted(set(hf_state) - set(sent)) == ["model.layers.3.embed_tokens.weight",
                                                 "model.layers.3.shared_head.head.weight"]
    assert all(torch.equal(sent[n], hf_state[n]) for n in sent)
