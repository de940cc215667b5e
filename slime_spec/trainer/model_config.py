"""megatron-core's TransformerConfig (MLATransformerConfig for multi-latent attention) equivalent to an HF config:
which families the trainer builds, and each family's attention and MoE fields. Pure: reads a config.json dict,
refuses what megatron-core's local layers would compute differently from HF and SGLang, naming the key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime_spec.common.model_families import DENSE_FIRST_FAMILIES, FAMILIES, MLA_FAMILIES, QK_NORM_FAMILIES
from slime_spec.config.run_config import (
    TrainConfig,
    expert_tensor_parallel_size,
    moe_expert_layout_refusal,
)
from slime_spec.weight_sync import convert


def transformer_config(hf_config: dict, train: TrainConfig):
    """Megatron TransformerConfig equivalent to an HF Llama / Qwen2 / Qwen3 / Qwen3-MoE / MiMo / GLM-4.5 config;
    an MLATransformerConfig for DeepSeek-V3."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    family = convert.family_of(hf_config)
    if family not in FAMILIES:
        raise ValueError(f"the trainer builds {', '.join(FAMILIES)} models; {family} is conversion-only")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config['hidden_act']!r}: the trainer builds SwiGLU (silu) MLPs only")
    if hf_config.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported (Megatron's local spec: no MLP bias)")
    if family in QK_NORM_FAMILIES and hf_config.get("attention_bias"):
        raise ValueError(f"attention_bias=true in a {family} config.json: Qwen3 then has q/k/v and o_proj biases; the "
                         "trainer builds Qwen3 without them, as Qwen3's checkpoints are (set attention_bias false)")
    hf_mtp = int(hf_config.get("num_nextn_predict_layers", 0) or 0)
    if train.mtp_num_layers and family not in convert.MTP_FAMILIES:
        raise ValueError(f"--mtp-num-layers {train.mtp_num_layers}: {family} checkpoints have no MTP layers for "
                         f"the engines to serve; use a checkpoint with MTP layers ({', '.join(convert.MTP_FAMILIES)}) "
                         f"or --mtp-num-layers 0")
    if train.mtp_num_layers > hf_mtp and not train.load:
        raise ValueError(f"--mtp-num-layers {train.mtp_num_layers}: the HF checkpoint has only "
                         f"num_nextn_predict_layers={hf_mtp} MTP layers to load")
    if train.enable_mtp_training and not train.mtp_num_layers:
        raise ValueError("--enable-mtp-training needs --mtp-num-layers >= 1")
    from slime_spec.trainer.pipeline import stage_layer_counts
    stage_layer_counts(hf_config["num_hidden_layers"], train.pipeline_model_parallel_size,
                       train.decoder_first_pipeline_num_layers, train.decoder_last_pipeline_num_layers)
    heads = hf_config["num_attention_heads"]
    config_class, attention = (MLATransformerConfig, mla_config(hf_config)) if family in MLA_FAMILIES \
        else (TransformerConfig, {})
    return config_class(
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf_config.get("num_key_value_heads") or heads,
        kv_channels=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family in ("qwen2", "mimo") or bool(hf_config.get("attention_bias")),
        # MLA: the q / kv latent RMSNorms (q_a_layernorm, kv_a_layernorm) are its q_layernorm / kv_layernorm
        qk_layernorm=family in QK_NORM_FAMILIES + MLA_FAMILIES
        or bool(family == "glm4_moe" and hf_config.get("use_qk_norm")),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=torch.bfloat16 if train.bf16 else torch.float32,
        bf16=train.bf16,
        tensor_model_parallel_size=train.tensor_model_parallel_size,
        pipeline_model_parallel_size=train.pipeline_model_parallel_size,
        context_parallel_size=train.context_parallel_size,
        pipeline_dtype=torch.bfloat16 if train.bf16 else torch.float32,  # the activations passed between stages
        num_layers_in_first_pipeline_stage=train.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=train.decoder_last_pipeline_num_layers,
        # the trainer's losses are already weighted sums: megatron-core's schedule must not divide them by the number
        # of micro-batches (pipeline.run_schedule)
        calculate_per_token_loss=True,
        mtp_num_layers=train.mtp_num_layers or None,
        mtp_loss_scaling_factor=train.mtp_loss_scaling_factor,
        **moe_config(hf_config, family, train),
        **attention,
    )


def mla_config(hf_config: dict) -> dict:
    """megatron-core's MLA fields for a DeepSeek-V3 config: latent ranks, head dims, RoPE (YaRN as the released
    checkpoints, or plain) with HF's defaults for the YaRN numbers a config leaves out."""
    if hf_config.get("attention_bias"):
        raise ValueError("attention_bias=true in a deepseek_v3 config.json: megatron-core's MLA projections have no "
                         "bias (DeepSeek-V3's checkpoints have none; set attention_bias false)")
    params = hf_config.get("rope_parameters") or {}
    scaling = {**params, **(hf_config.get("rope_scaling") or {})}  # the new and the old spelling
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope_scaling type {rope_type!r}: the trainer builds DeepSeek-V3 with YaRN (as released) or "
                         f"plain RoPE")
    theta = float(hf_config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_fields = dict(rope_type="rope", rotary_base=theta)
    if rope_type == "yarn":
        rope_fields.update(
            rope_type="yarn", rotary_scaling_factor=float(scaling["factor"]),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
            beta_fast=float(scaling.get("beta_fast", 32)), beta_slow=float(scaling.get("beta_slow", 1)),
            mscale=float(scaling.get("mscale", 1)), mscale_all_dim=float(scaling.get("mscale_all_dim", 0)))
    else:  # megatron's MLA scales its softmax by YaRN's mscale of rotary_scaling_factor: 1 leaves it plain
        rope_fields.update(rotary_scaling_factor=1.0)
    q_rank = hf_config.get("q_lora_rank")
    return dict(q_lora_rank=int(q_rank) if q_rank else None, kv_lora_rank=int(hf_config["kv_lora_rank"]),
                qk_head_dim=int(hf_config["qk_nope_head_dim"]), qk_pos_emb_head_dim=int(hf_config["qk_rope_head_dim"]),
                v_head_dim=int(hf_config["v_head_dim"]), **rope_fields)


def moe_config(hf_config: dict, family: str, train: TrainConfig) -> dict:
    """megatron-core's MoE fields for a Qwen3-MoE, GLM-4.5 or DeepSeek-V3 config (none for a dense family)."""
    ep = train.expert_model_parallel_size
    if family not in convert.MOE_FAMILIES:
        if ep > 1:
            raise ValueError(f"--expert-model-parallel-size {ep} with a {family} model: it has no experts to split; "
                             f"use --expert-model-parallel-size 1")
        return {}
    experts = convert.num_experts(hf_config)
    if ep < 1 or experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep}: must divide the {experts} routed experts of the "
                         f"{family} model (config.json); choose a divisor of {experts}")
    tp = train.tensor_model_parallel_size
    if why := moe_expert_layout_refusal(tp, ep, train.expert_tensor_parallel_size):
        raise ValueError(f"the experts of a {family} model: {why}")
    layout = dict(expert_model_parallel_size=ep, sequence_parallel=tp > 1,  # megatron-core's MoE layer under TP
                  expert_tensor_parallel_size=expert_tensor_parallel_size(tp, train.expert_tensor_parallel_size))
    if family in DENSE_FIRST_FAMILIES:
        return {**dense_first_moe_config(hf_config), **layout}
    if hf_config.get("mlp_only_layers") or int(hf_config.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"mlp_only_layers={hf_config.get('mlp_only_layers')}, decoder_sparse_step="
                         f"{hf_config.get('decoder_sparse_step')}: the trainer builds Qwen3-MoE with every layer "
                         f"sparse (as Qwen3-30B-A3B and Qwen3-235B-A22B)")
    return dict(
        **layout,
        num_moe_experts=int(hf_config["num_experts"]),
        moe_router_topk=int(hf_config["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf_config["moe_intermediate_size"]),
        moe_router_score_function="softmax",
        # softmax over the top-k logits is the top-k of the full softmax renormalized (norm_topk_prob); without
        # renormalizing, the softmax comes first over every expert
        moe_router_pre_softmax=not hf_config.get("norm_topk_prob", False),
        moe_router_load_balancing_type="none",  # policy training: the router moves only by the policy's loss
        moe_aux_loss_coeff=0.0,
        # both dispatchers compute the same; the all-to-all one asks for CUDA streams when built
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
        moe_grouped_gemm=False,
    )


def dense_first_moe_config(hf_config: dict) -> dict:
    """GLM-4.5's and DeepSeek-V3's MoE as megatron-core's: sigmoid scores, the top-k chosen on score + correction
    bias (the router's expert bias), within the `topk_group` best of `n_group` expert groups (a group scored by its
    two best experts), weighted by the chosen scores renormalized and scaled by `routed_scaling_factor`, shared
    experts beside the routed ones, dense layers before `first_k_dense_replace`; the router in float32, as HF and
    SGLang compute it."""
    layers, dense = int(hf_config["num_hidden_layers"]), int(hf_config.get("first_k_dense_replace", 0))
    if not hf_config.get("norm_topk_prob", True):
        raise ValueError("norm_topk_prob=false: megatron-core's sigmoid routing renormalizes the top-k weights; the "
                         "trainer builds this family with norm_topk_prob true (as GLM-4.5 and DeepSeek-V3 ship)")
    scoring, method = hf_config.get("scoring_func", "sigmoid"), hf_config.get("topk_method", "noaux_tc")
    if (scoring, method) != ("sigmoid", "noaux_tc"):
        raise ValueError(f"scoring_func={scoring!r}, topk_method={method!r}: the trainer builds sigmoid routing over a "
                         f"correction bias (scoring_func 'sigmoid', topk_method 'noaux_tc', as DeepSeek-V3 ships)")
    if int(hf_config.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"moe_layer_freq={hf_config['moe_layer_freq']}: the trainer builds every layer from "
                         f"first_k_dense_replace on sparse (moe_layer_freq 1, as DeepSeek-V3 ships)")
    topk, groups = int(hf_config["num_experts_per_tok"]), int(hf_config.get("n_group") or 1)
    group_topk = int(hf_config.get("topk_group") or groups)
    if groups > 1 and (group_topk < 1 or topk // group_topk != 2):
        # megatron-core scores a group by its topk // group_topk best experts; HF and SGLang by its 2 best
        raise ValueError(f"num_experts_per_tok={topk}, topk_group={group_topk}: megatron-core scores an expert "
                         f"group by its num_experts_per_tok // topk_group best experts, DeepSeek-V3 by its 2 best; the "
                         f"trainer builds group-limited routing where the two agree (num_experts_per_tok = 2 x "
                         f"topk_group, as DeepSeek-V3's 8 and 4)")
    if not 0 <= dense <= layers:
        raise ValueError(f"first_k_dense_replace={dense}: choose 0..num_hidden_layers={layers}")
    shared = int(hf_config.get("n_shared_experts") or 0)
    return dict(
        num_moe_experts=int(hf_config["n_routed_experts"]),
        moe_router_topk=int(hf_config["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf_config["moe_intermediate_size"]),
        moe_shared_expert_intermediate_size=shared * int(hf_config["moe_intermediate_size"]) if shared else None,
        moe_layer_freq=[0] * dense + [1] * (layers - dense),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # the checkpoint's correction bias, kept: no load-balancing updates
        moe_router_topk_scaling_factor=float(hf_config.get("routed_scaling_factor") or 1.0),
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
        moe_grouped_gemm=False,
    )
