"""What slime-spec does with each flag of the slime table (`flags.GROUPS`) that it does not act on.

Each entry says whether ignoring the flag is harmless here (doctor: an info finding saying why) or would
silently change what the user gets (doctor: FLAG_NOT_SUPPORTED, with the fix). The flags that exist only in
slime's and Megatron's parsers are classified beside their table rows, in `flags_upstream.py`; `flags.py`
merges both into `NOT_ACTED_ON`.
"""

from __future__ import annotations

from slime_spec.config.flags_upstream import EXTENSION_FIX as _EXTENSION_FIX
from slime_spec.config.flags_upstream import FROM_CONFIG_JSON as _FROM_CONFIG_JSON
from slime_spec.config.flags_upstream import MEGATRON_PERF as _MEGATRON_PERF
from slime_spec.config.flags_upstream import Ignored
from slime_spec.config.flags_upstream import refused as _refused
from slime_spec.config.flags_upstream import trainer as _trainer
from slime_spec.config.parallel_sizes import data_parallel_size

NOT_ACTED_ON: dict[str, Ignored] = {
    # cluster and checkpoints
    "rollout_num_gpus_per_node": Ignored("engines are placed by Ray placement groups over the whole cluster"),
    "offload": Ignored("with --colocate the engines release their GPU memory while the trainer runs; "
                         "without it there is nothing to offload"),
    "no_load_optim": _trainer("the trainer restores the optimizer state --load holds", "drop --no-load-optim, or "
                              "start from a checkpoint without optimizer state (--hf-checkpoint alone)"),
    "no_load_rng": Ignored("checkpoints here hold no RNG state; seeds come from --seed and --rollout-seed"),
    "finetune": _trainer("--load resumes the iteration count and optimizer state here",
                         "drop --finetune and start from --hf-checkpoint without --load"),
    # rollout
    "metadata_key": _refused("prompt metadata is not read", "drop --metadata-key (reward functions get "
                             "the prompt and --label-key)", accepted=(None, "metadata")),
    "num_epoch": _refused("the run length is --num-rollout", "--num-rollout <rollouts> instead of --num-epoch"),
    "partial_rollout": _refused("partial rollout (resuming cut-off samples in the next rollout) is not "
                                "implemented", "drop --partial-rollout; every sample finishes in its rollout"),
    "balance_data": Ignored("without --max-tokens-per-gpu the samples of a step are dealt to the data-parallel "
                            "ranks in order, not balanced by tokens", "add --max-tokens-per-gpu N (packed "
                            "micro-batches; each step's samples balanced by tokens over the data-parallel ranks)",
                            accepted=(None, False), trainer_only=True, covered_by=lambda ns: bool(
                                ns.max_tokens_per_gpu) or data_parallel_size(
                                ns.actor_num_nodes * ns.actor_num_gpus_per_node, ns.tensor_model_parallel_size,
                                ns.pipeline_model_parallel_size, ns.context_parallel_size) == 1,
                            covered_why="the samples are balanced by tokens over the data-parallel ranks already: "
                                        "with --max-tokens-per-gpu each optimizer step's samples are dealt to them "
                                        "by tokens (equal counts), and one data-parallel rank has nothing to balance"),
    "sglang_router_ip": _refused("an external router is not used", "drop it; --use-sglang-router starts one"),
    "sglang_router_port": _refused("an external router is not used", "drop it; --use-sglang-router starts one"),
    # GRPO / PPO
    "kl_coef": _trainer("a KL penalty in the reward is not implemented", "--use-kl-loss --kl-loss-coef <c> "
                        "(KL in the loss) instead", accepted=(None, 0.0)),
    # optimizer
    "min_lr": Ignored("the learning rate is constant here (the only --lr-decay-style), so there is no minimum"),
    "lr_decay_style": _trainer("the learning rate is constant", "--lr-decay-style constant",
                               accepted=(None, "constant")),
    "lr_warmup_iters": _trainer("the learning rate has no warm-up", "--lr-warmup-iters 0", accepted=(None, 0)),
    "optimizer_cpu_offload": _MEGATRON_PERF,
    "overlap_cpu_optimizer_d2h_h2d": _MEGATRON_PERF,
    "use_precision_aware_optimizer": _MEGATRON_PERF,
    # model flags the trainer does not need (the shape flags are checked against config.json: MODEL_SHAPE_FLAGS)
    **{d: _FROM_CONFIG_JSON for d in (
        "position_embedding_type", "rotary_percent", "rotary_scaling_factor", "qk_layernorm",
        "make_vocab_size_divisible_by", "seq_length", "multi_latent_attention", "q_lora_rank", "kv_lora_rank",
        "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_experts", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size", "moe_router_topk", "moe_layer_freq", "moe_router_score_function",
        "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_load_balancing_type",
        "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
        "moe_router_group_topk", "moe_router_dtype", "moe_aux_loss_coeff", "moe_grouped_gemm",
        "moe_permute_fusion", "moe_token_dispatcher_type", "moe_enable_deepep")},
    "fp16": _trainer("float16 training (with its loss scaling) is not implemented", "--bf16 (bfloat16 with "
                     "float32 master weights) or neither (float32)"),
    # Megatron parallelism and performance
    "sequence_parallel": _MEGATRON_PERF,
    # --expert-model-parallel-size, --pipeline-model-parallel-size, the stages' layer counts and
    # --context-parallel-size are acted on (trainer/parallel.py, trainer/pipeline.py, trainer/context_parallel.py)
    "recompute_granularity": _MEGATRON_PERF,
    "recompute_method": _MEGATRON_PERF,
    "recompute_num_layers": _MEGATRON_PERF,
    "attention_dropout": _trainer("the trainer runs without dropout", "--attention-dropout 0.0",
                                  accepted=(None, 0.0)),
    "hidden_dropout": _trainer("the trainer runs without dropout", "--hidden-dropout 0.0", accepted=(None, 0.0)),
    "accumulate_allreduce_grads_in_fp32": Ignored("gradients are float32 here already"),
    "attention_softmax_in_fp32": Ignored("attention is computed in float32 here already"),
    "attention_backend": _MEGATRON_PERF,
    "use_distributed_optimizer": _MEGATRON_PERF,
    "overlap_grad_reduce": _MEGATRON_PERF,
    "overlap_param_gather": _MEGATRON_PERF,
    # slime's extension points
    "rollout_function_path": _refused(
        "slime's rollout function is replaced by slime-spec's own rollout", "--custom-generate-function-path "
        "<module.fn> to customize generation per sample",
        accepted=(None, "slime.rollout.sglang_rollout.generate_rollout")),
    "eval_function_path": _refused("evaluation uses the rollout's generation", "--custom-generate-function-path "
                                   "(used for eval too) and --eval-prompt-data"),
    "data_source_path": _refused("prompts come from --prompt-data (JSONL) only", "--prompt-data <file.jsonl> "
                                 "with --input-key / --label-key",
                                 accepted=(None, "slime.rollout.data_source.RolloutDataSourceWithBuffer")),
    "rollout_sample_hook_path": _refused("per-sample hooks are not implemented", "--custom-generate-function-path "
                                         "(generation) or --custom-rm-path (reward)"),
    "custom_rollout_log_function_path": _refused("rollout logging is fixed", "--metrics-jsonl <file> and "
                                                 "--use-wandb"),
    "custom_eval_rollout_log_function_path": _refused("eval logging is fixed", "--metrics-jsonl <file> and "
                                                      "--use-wandb"),
    "buffer_filter_path": _refused("there is no rollout buffer", _EXTENSION_FIX),
    "rollout_data_postprocess_path": _refused("rollout data post-processing is not implemented", _EXTENSION_FIX),
    "custom_loss_function_path": _refused("the trainer's losses are built in", "--loss-type policy_loss or "
                                          "sft_loss with --advantage-estimator"),
    "custom_advantage_function_path": _refused("advantages are built in", "--advantage-estimator grpo"),
    "custom_tis_function_path": _refused("a custom importance-sampling function is not loaded: --use-tis applies "
                                         "slime's built-in (vanilla) truncated importance sampling",
                                         "drop it (keep --use-tis --tis-clip --tis-clip-low)"),
    "custom_pg_loss_reducer_function_path": _refused("the policy loss is reduced over --global-batch-size",
                                                     _EXTENSION_FIX),
    "rm_url": _refused("a remote reward model service is not called", "--custom-rm-path <module.fn> that calls "
                       "your service"),
    "custom_reward_post_process_path": _refused("rewards become GRPO group-normalized advantages",
                                                "--custom-rm-path <module.fn> to shape the reward itself"),
    "custom_convert_samples_to_train_data_path": _refused("samples become training data in the trainer",
                                                          _EXTENSION_FIX),
    "rollout_sample_filter_path": _refused("samples are not filtered from the loss", "--custom-rm-path to "
                                           "score unwanted samples"),
    "rollout_all_samples_process_path": _refused("samples are not post-processed", _EXTENSION_FIX),
    "custom_model_provider_path": _refused("the trainer builds the model from config.json", _EXTENSION_FIX),
    "custom_megatron_init_path": _refused("Megatron initialisation is fixed", _EXTENSION_FIX),
    "custom_megatron_before_log_prob_hook_path": _refused("the trainer has no hooks", _EXTENSION_FIX),
    "custom_megatron_before_train_step_hook_path": _refused("the trainer has no hooks", _EXTENSION_FIX),
    "custom_update_weight_post_write_path": _refused("weight sync has no hooks", "--weight-sync-transport "
                                                     "distributed, tensor or disk"),
    "custom_config_path": _refused("custom functions take no YAML arguments", "--config <file.yaml> for flags"),
    "megatron_config_path": _refused("Megatron roles are not configured from YAML", "--config <file.yaml> "
                                     "with flag names as keys"),
}
