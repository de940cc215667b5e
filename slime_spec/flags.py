"""The slime-compatible flag table: the one place each flag's name, type and default is written.

slime's own parser is Megatron's plus slime's; we keep the flags slime users write in their
scripts. `ACTED_ON` lists what slime-spec actually uses; anything else parses and `doctor`
reports it as an info finding, so an existing slime script runs unchanged. The typed configs
(`config.py`) take their defaults from here through `default`.
"""

from __future__ import annotations

# (flag, argparse kwargs). `type` defaults to str; `action="store_true"` for switches.
_I, _F = {"type": int}, {"type": float}
_ON = {"action": "store_true"}

GROUPS: dict[str, list[tuple[str, dict]]] = {
    "cluster": [
        ("--actor-num-nodes", {**_I, "default": 1}),
        ("--actor-num-gpus-per-node", {**_I, "default": 1}),
        ("--rollout-num-gpus", {**_I, "default": None}),
        ("--rollout-num-gpus-per-engine", {**_I, "default": 1}),
        ("--rollout-num-gpus-per-node", {**_I, "default": None}),
        ("--colocate", _ON),
        ("--offload", _ON),
    ],
    "checkpoints": [
        ("--hf-checkpoint", {"default": None}),
        ("--load", {"default": None}),
        ("--save", {"default": None}),
        ("--ref-load", {"default": None}),
        ("--save-interval", {**_I, "default": None}),
        ("--no-load-optim", _ON),
        ("--no-load-rng", _ON),
        ("--finetune", _ON),
    ],
    "rollout": [
        ("--prompt-data", {"default": None}),
        ("--input-key", {"default": "input"}),
        ("--label-key", {"default": None}),
        ("--metadata-key", {"default": "metadata"}),
        ("--apply-chat-template", _ON),
        ("--rollout-shuffle", _ON),
        ("--rollout-seed", {**_I, "default": 42}),
        ("--rm-type", {"default": None}),
        ("--custom-rm-path", {"default": None}),
        ("--custom-generate-function-path", {"default": None}),
        ("--num-rollout", {**_I, "default": 1}),
        ("--num-epoch", {**_I, "default": None}),
        ("--rollout-batch-size", {**_I, "default": 8}),
        ("--n-samples-per-prompt", {**_I, "default": 1}),
        ("--rollout-max-response-len", {**_I, "default": 64}),
        ("--rollout-max-prompt-len", {**_I, "default": None}),
        ("--rollout-temperature", {**_F, "default": 1.0}),
        ("--rollout-top-p", {**_F, "default": 1.0}),
        ("--rollout-top-k", {**_I, "default": -1}),
        ("--rollout-stop", {"nargs": "+", "default": None}),
        ("--rollout-stop-token-ids", {"nargs": "+", "type": int, "default": None}),
        ("--rollout-skip-special-tokens", _ON),
        ("--global-batch-size", {**_I, "default": None}),
        ("--micro-batch-size", {**_I, "default": 1}),
        ("--num-steps-per-rollout", {**_I, "default": None}),
        ("--over-sampling-batch-size", {**_I, "default": None}),
        ("--dynamic-sampling-filter-path", {"default": None}),
        ("--partial-rollout", _ON),
        ("--balance-data", _ON),
        ("--sglang-server-concurrency", {**_I, "default": 64}),
        ("--sglang-router-ip", {"default": None}),
        ("--sglang-router-port", {**_I, "default": None}),
        ("--use-sglang-router", _ON),
    ],
    "eval": [
        ("--eval-interval", {**_I, "default": None}),
        ("--eval-prompt-data", {"nargs": "+", "default": None}),
        ("--n-samples-per-eval-prompt", {**_I, "default": 1}),
        ("--eval-max-response-len", {**_I, "default": None}),
        ("--eval-temperature", {**_F, "default": None}),
        ("--eval-top-p", {**_F, "default": None}),
        ("--eval-top-k", {**_I, "default": None}),
    ],
    "grpo": [
        ("--advantage-estimator", {"default": "grpo", "choices": ["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]}),
        ("--loss-type", {"default": "policy_loss", "choices": ["policy_loss", "sft", "sft_loss"]}),
        ("--eps-clip", {**_F, "default": 0.2}),
        ("--eps-clip-high", {**_F, "default": None}),
        ("--eps-clip-c", {**_F, "default": None}),
        ("--use-kl-loss", _ON),
        ("--kl-loss-coef", {**_F, "default": 0.0}),
        ("--kl-loss-type", {"default": "low_var_kl", "choices": ["kl", "k1", "k2", "k3", "low_var_kl"]}),
        ("--kl-coef", {**_F, "default": 0.0}),
        ("--entropy-coef", {**_F, "default": 0.0}),
        ("--normalize-advantages", _ON),
        ("--use-tis", _ON),
    ],
    "optimizer": [
        ("--optimizer", {"default": "adam", "choices": ["adam", "sgd"]}),
        ("--lr", {**_F, "default": 1e-6}),
        ("--min-lr", {**_F, "default": 0.0}),
        ("--lr-decay-style", {"default": "constant"}),
        ("--lr-warmup-iters", {**_I, "default": 0}),
        ("--weight-decay", {**_F, "default": 0.0}),
        ("--adam-beta1", {**_F, "default": 0.9}),
        ("--adam-beta2", {**_F, "default": 0.999}),
        ("--adam-eps", {**_F, "default": 1e-8}),
        ("--clip-grad", {**_F, "default": 1.0}),
        ("--optimizer-cpu-offload", _ON),
        ("--overlap-cpu-optimizer-d2h-h2d", _ON),
        ("--use-precision-aware-optimizer", _ON),
        ("--seed", {**_I, "default": 1234}),
    ],
    "wandb": [
        ("--use-wandb", _ON),
        ("--wandb-project", {"default": None}),
        ("--wandb-group", {"default": None}),
        ("--wandb-key", {"default": None}),
        ("--wandb-dir", {"default": None}),
        ("--wandb-host", {"default": None}),
        ("--wandb-team", {"default": None, "help": "wandb entity (team or user) of the run"}),
        ("--wandb-mode", {"default": None, "choices": ["online", "offline", "disabled"],
                          "help": "default: WANDB_MODE, else online with an API key or a `wandb login`, else offline"}),
        ("--wandb-run-id", {"default": None, "help": "resume (or name) this wandb run id"}),
    ],
    "debug": [
        ("--debug-rollout-only", _ON),
        ("--debug-train-only", _ON),
        ("--save-debug-rollout-data", {"default": None}),
        ("--load-debug-rollout-data", {"default": None}),
    ],
    "speculative training": [
        ("--mtp-num-layers", {**_I, "default": 0}),
        ("--enable-mtp-training", _ON),
        ("--mtp-loss-scaling-factor", {**_F, "default": 0.2}),
    ],
    "model (Megatron MODEL_ARGS; checked against the HF config.json)": [
        ("--swiglu", _ON),
        ("--num-layers", {**_I, "default": None}),
        ("--hidden-size", {**_I, "default": None}),
        ("--ffn-hidden-size", {**_I, "default": None}),
        ("--num-attention-heads", {**_I, "default": None}),
        ("--group-query-attention", _ON),
        ("--num-query-groups", {**_I, "default": None}),
        ("--kv-channels", {**_I, "default": None}),
        ("--use-rotary-position-embeddings", _ON),
        ("--position-embedding-type", {"default": None}),
        ("--rotary-base", {**_F, "default": None}),
        ("--rotary-percent", {**_F, "default": None}),
        ("--rotary-scaling-factor", {**_F, "default": None}),
        ("--disable-bias-linear", _ON),
        ("--add-qkv-bias", _ON),
        ("--qk-layernorm", _ON),
        ("--normalization", {"default": None}),
        ("--norm-epsilon", {**_F, "default": None}),
        ("--vocab-size", {**_I, "default": None}),
        ("--make-vocab-size-divisible-by", {**_I, "default": None}),
        ("--untie-embeddings-and-output-weights", _ON),
        ("--max-position-embeddings", {**_I, "default": None}),
        ("--seq-length", {**_I, "default": None}),
        ("--multi-latent-attention", _ON),
        ("--q-lora-rank", {**_I, "default": None}),
        ("--kv-lora-rank", {**_I, "default": None}),
        ("--qk-head-dim", {**_I, "default": None}),
        ("--qk-pos-emb-head-dim", {**_I, "default": None}),
        ("--v-head-dim", {**_I, "default": None}),
        ("--num-experts", {**_I, "default": None}),
        ("--moe-ffn-hidden-size", {**_I, "default": None}),
        ("--moe-shared-expert-intermediate-size", {**_I, "default": None}),
        ("--moe-router-topk", {**_I, "default": None}),
        ("--moe-layer-freq", {"default": None}),
        ("--moe-router-score-function", {"default": None}),
        ("--moe-router-enable-expert-bias", _ON),
        ("--moe-router-bias-update-rate", {**_F, "default": None}),
        ("--moe-router-load-balancing-type", {"default": None}),
        ("--moe-router-pre-softmax", _ON),
        ("--moe-router-topk-scaling-factor", {**_F, "default": None}),
        ("--moe-router-num-groups", {**_I, "default": None}),
        ("--moe-router-group-topk", {**_I, "default": None}),
        ("--moe-router-dtype", {"default": None}),
        ("--moe-aux-loss-coeff", {**_F, "default": None}),
        ("--moe-grouped-gemm", _ON),
        ("--moe-permute-fusion", _ON),
        ("--moe-token-dispatcher-type", {"default": None}),
        ("--moe-enable-deepep", _ON),
        ("--bf16", _ON),
        ("--fp16", _ON),
    ],
    "perf (Megatron PERF_ARGS)": [
        ("--tensor-model-parallel-size", {**_I, "default": 1}),
        ("--sequence-parallel", _ON),
        ("--pipeline-model-parallel-size", {**_I, "default": 1}),
        ("--context-parallel-size", {**_I, "default": 1}),
        ("--expert-model-parallel-size", {**_I, "default": 1}),
        ("--expert-tensor-parallel-size", {**_I, "default": 1}),
        ("--decoder-last-pipeline-num-layers", {**_I, "default": None}),
        ("--decoder-first-pipeline-num-layers", {**_I, "default": None}),
        ("--recompute-granularity", {"default": None}),
        ("--recompute-method", {"default": None}),
        ("--recompute-num-layers", {**_I, "default": None}),
        ("--use-dynamic-batch-size", _ON),
        ("--max-tokens-per-gpu", {**_I, "default": None}),
        ("--attention-dropout", {**_F, "default": 0.1}),
        ("--hidden-dropout", {**_F, "default": 0.1}),
        ("--accumulate-allreduce-grads-in-fp32", _ON),
        ("--attention-softmax-in-fp32", _ON),
        ("--attention-backend", {"default": None}),
        ("--use-distributed-optimizer", _ON),
        ("--overlap-grad-reduce", _ON),
        ("--overlap-param-gather", _ON),
    ],
    "slime-spec": [
        ("--config", {"default": None, "help": "YAML file; keys are flag names without dashes; command-line flags win"}),
        ("--rollout-backend", {"default": None, "choices": ["sglang", "embedded"],
                               "help": "default: sglang when a CUDA GPU and a full SGLang are present, else embedded"}),
        ("--rollout-num-engines", {**_I, "default": 1, "help": "engines on machines without GPUs"}),
        ("--metrics-jsonl", {"default": None, "help": "append one JSON object per rollout"}),
        ("--output-dir", {"default": "outputs"}),
        ("--update-weight-buffer-size", {**_I, "default": 512 * 1024**2}),
        ("--weight-sync-transport", {"default": None, "choices": ["distributed", "tensor", "disk"],
                                     "help": "default: distributed when engines are separate, tensor with --colocate"}),
        ("--check-weight-sync", _ON),
        ("--engine-start-timeout", {**_F, "default": 1800.0,
                                    "help": "upper bound in seconds on an engine server's start-up; the wait goes on "
                                            "only while the process is alive and not yet healthy. Large engines "
                                            "(DeepSeek/GLM at TP8, CUDA graph capture) take well over 300 s"}),
        ("--rollout-request-retries", {**_I, "default": 3,
                                       "help": "resubmissions of a request whose engine died (after its restart)"}),
    ],
}


def dest(flag: str) -> str:
    """argparse's attribute name for a flag: '--rollout-top-p' -> 'rollout_top_p'."""
    return flag.removeprefix("--").replace("-", "_")


def _table_default(kwargs: dict):
    return kwargs.get("default", False if kwargs.get("action") == "store_true" else None)


DEFAULTS: dict[str, object] = {dest(flag): _table_default(kw) for entries in GROUPS.values() for flag, kw in entries}
MULTI_VALUE = {dest(flag) for entries in GROUPS.values() for flag, kw in entries if "nargs" in kw}


def config_value(name: str, value):
    """A parsed flag value as the frozen configs hold it: multi-value flags become tuples (unset: ())."""
    return tuple(value or ()) if name in MULTI_VALUE else value


def default(name: str):
    """The default of flag dest `name`, as the configs hold it; KeyError names a dest not in the table."""
    if name not in DEFAULTS:
        raise KeyError(f"{name!r} is not a flag dest in slime_spec/flags.py GROUPS")
    return config_value(name, DEFAULTS[name])


# Flags whose value slime-spec acts on. Others parse and are reported by `doctor` when set.
ACTED_ON = {
    "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "rollout_num_gpus_per_engine", "colocate",
    "hf_checkpoint", "load", "save", "ref_load", "save_interval",
    "prompt_data", "input_key", "label_key", "apply_chat_template", "rollout_shuffle", "rollout_seed", "rm_type",
    "custom_rm_path", "custom_generate_function_path", "num_rollout", "rollout_batch_size", "n_samples_per_prompt",
    "rollout_max_response_len", "rollout_max_prompt_len", "rollout_temperature", "rollout_top_p", "rollout_top_k",
    "rollout_stop", "rollout_stop_token_ids", "rollout_skip_special_tokens", "global_batch_size", "micro_batch_size",
    "sglang_server_concurrency", "use_sglang_router",
    "eval_interval", "eval_prompt_data", "eval_temperature", "eval_top_p", "eval_top_k", "eval_max_response_len",
    "n_samples_per_eval_prompt",
    "advantage_estimator", "loss_type", "eps_clip", "eps_clip_high", "use_kl_loss", "kl_loss_coef", "kl_loss_type",
    "entropy_coef", "optimizer", "lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "seed",
    "use_wandb", "wandb_project", "wandb_group", "wandb_key", "wandb_dir", "wandb_host", "wandb_team", "wandb_mode",
    "wandb_run_id",
    "debug_rollout_only", "debug_train_only", "save_debug_rollout_data", "load_debug_rollout_data",
    "mtp_num_layers", "enable_mtp_training", "mtp_loss_scaling_factor",
    "tensor_model_parallel_size",
    "config", "rollout_backend", "rollout_num_engines", "metrics_jsonl", "output_dir", "update_weight_buffer_size",
    "weight_sync_transport", "check_weight_sync", "engine_start_timeout", "rollout_request_retries",
    # Model-shape flags: the trainer builds the model from config.json; these are checked against it.
    "swiglu", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "kv_channels", "use_rotary_position_embeddings", "rotary_base", "disable_bias_linear",
    "add_qkv_bias", "normalization", "norm_epsilon", "vocab_size", "untie_embeddings_and_output_weights",
    "max_position_embeddings",
}



# SGLang server flags the framework sets itself; a `--sglang-` form of these is refused.
FRAMEWORK_OWNED_SGLANG = {
    "model_path": "set from --hf-checkpoint",
    "tokenizer_path": "set from --hf-checkpoint",
    "tp_size": "set from --rollout-num-gpus-per-engine",
    "host": "chosen by the engine actor",
    "port": "chosen by the engine actor (a free port)",
    "nnodes": "set by slime-spec (an engine spanning several nodes is not supported yet)",
    "node_rank": "set by the engine actor",
    "dist_init_addr": "set by the engine actor",
    "base_gpu_id": "set from the engine's placement-group bundle",
    "random_seed": "set from --seed",
}

# Megatron model flag -> (HF config keys in order of preference, how to compare).
MODEL_SHAPE_FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "num_layers": (("num_hidden_layers",), "int"),
    "hidden_size": (("hidden_size",), "int"),
    "ffn_hidden_size": (("intermediate_size",), "int"),
    "num_attention_heads": (("num_attention_heads",), "int"),
    "num_query_groups": (("num_key_value_heads",), "int"),
    "kv_channels": (("head_dim",), "int"),
    "rotary_base": (("rope_theta",), "float"),
    "norm_epsilon": (("rms_norm_eps", "layer_norm_epsilon"), "float"),
    "vocab_size": (("vocab_size",), "int"),
    "max_position_embeddings": (("max_position_embeddings",), "int"),
    "untie_embeddings_and_output_weights": (("tie_word_embeddings",), "untied"),
    "add_qkv_bias": (("attention_bias",), "qkv_bias"),
}
