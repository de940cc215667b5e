"""The slime-compatible flag table: the one place each flag's name, type and default is written.

slime's own parser is Megatron's plus slime's; every flag of slime's train.py and every Megatron flag of
slime's scripts parses (those slime-spec never acts on are in `config/flags_upstream.py`, merged here).
`ACTED_ON` lists what slime-spec actually uses; `NOT_ACTED_ON` (written in `flags_not_acted_on.py` and
`flags_upstream.py`) says, for every other flag, whether ignoring it is harmless here (doctor: an info
finding saying why) or would silently change what the user gets (doctor: FLAG_NOT_SUPPORTED, with the
fix). A flag outside the table stops the run unless `--allow-unknown-flags`. The typed configs
(`run_config.py`) take their defaults from here through `default`.
"""

from __future__ import annotations

import argparse

from slime_spec.config import flags_upstream as U
from slime_spec.config.flags_not_acted_on import NOT_ACTED_ON as TABLE_NOT_ACTED_ON
from slime_spec.config.flags_upstream import Ignored

# (flag, argparse kwargs). `type` defaults to str; `action="store_true"` for switches.
_I, _F = {"type": int}, {"type": float}
_ON = {"action": "store_true"}


def _switches(*flags: str) -> list[tuple[str, dict]]:
    return [(flag, _ON) for flag in flags]


def _unset(kind: type, *flags: str) -> list[tuple[str, dict]]:
    """Flags parsed as `kind` with no default: Megatron's model shape, which config.json decides here."""
    return [(flag, {"default": None} if kind is str else {"type": kind, "default": None}) for flag in flags]


GROUPS: dict[str, list[tuple[str, dict]]] = {
    "cluster": [
        ("--actor-num-nodes", {**_I, "default": 1}),
        ("--actor-num-gpus-per-node", {**_I, "default": 1}),
        ("--rollout-num-gpus", {**_I, "default": None}),
        ("--rollout-num-gpus-per-engine", {**_I, "default": 1}),
        ("--rollout-num-gpus-per-node", {**_I, "default": None}),
        ("--colocate", _ON),
        ("--offload", _ON),
        ("--offload-rollout", {"action": argparse.BooleanOptionalAction, "default": None,
                               "help": "with --colocate (default on, as slime): the engines start with SGLang's "
                                       "memory saver and release their GPU memory while the trainer runs"}),
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
        ("--rm-timeout", {**_F, "default": 300.0,
                          "help": "seconds one sample's reward may take; past it (or when the reward raises or is "
                                  "not a finite number) the sample is left out of training and counted in "
                                  "reward_failures"}),
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
        ("--sglang-server-concurrency", {**_I, "default": 512}),
        ("--sglang-router-ip", {"default": None}),
        ("--sglang-router-port", {**_I, "default": None}),
        ("--use-sglang-router", _ON),
        ("--rollout-history-drafting", {**_ON, "help": "draft from the group's siblings and the prompt's earlier "
                                        "rollouts (NGRAM; on the embedded backend also NEXTN/EAGLE: MTP + history, "
                                        "see docs/en/speculative.md)"}),
        ("--rollout-history-epochs", {**_I, "default": 1, "help": "earlier rollouts of a prompt kept for drafting"}),
        ("--rollout-history-max-tokens", {**_I, "default": 8192, "help": "history tokens kept per prompt"}),
    ],
    "eval": [
        ("--eval-interval", {**_I, "default": None}),
        ("--eval-prompt-data", {"nargs": "+", "default": None}),
        ("--n-samples-per-eval-prompt", {**_I, "default": 1}),
        ("--eval-max-response-len", {**_I, "default": None}),
        ("--eval-temperature", {**_F, "default": None}),
        ("--eval-top-p", {**_F, "default": None}),
        ("--eval-top-k", {**_I, "default": None}),
        ("--skip-eval-before-train", {**_ON, "help": "no eval before the first step (slime's switch)"}),
    ],
    "grpo": [
        ("--advantage-estimator", {"default": "grpo", "choices": ["grpo", "gspo", "reinforce_plus_plus",
                                                                  "reinforce_plus_plus_baseline", "ppo"]}),
        ("--loss-type", {"default": "policy_loss", "choices": ["policy_loss", "sft", "sft_loss"]}),
        ("--eps-clip", {**_F, "default": 0.2}),
        ("--eps-clip-high", {**_F, "default": None}),
        ("--eps-clip-c", {**_F, "default": None}),
        ("--use-kl-loss", _ON),
        ("--kl-loss-coef", {**_F, "default": 0.0}),
        ("--kl-loss-type", {"default": "k1", "choices": ["kl", "k1", "k2", "k3", "low_var_kl"]}),
        ("--kl-coef", {**_F, "default": 0.0}),
        ("--entropy-coef", {**_F, "default": 0.0}),
        ("--normalize-advantages", _ON),
        ("--disable-rewards-normalization", _ON),
        ("--disable-grpo-std-normalization", _ON),
        ("--use-tis", _ON),
        ("--tis-clip", {**_F, "default": 2.0}),
        ("--tis-clip-low", {**_F, "default": 0.0}),
        ("--use-rollout-logprobs", _ON),
        ("--calculate-per-token-loss", _ON),
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
        ("--max-consecutive-skipped-steps", {**_I, "default": 3,
                                             "help": "ours: an optimizer step whose loss or gradient norm is not "
                                                     "finite is skipped (as Megatron skips it); after this many in a "
                                                     "row the run stops naming what was not finite (0: never stop)"}),
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
        ("--mtp-unroll-steps", {**_I, "default": 1, "help": "ours: train the last MTP layer also on its own outputs, "
                                "this many steps ahead in all (NEXTN drafts --sglang-speculative-num-steps tokens by "
                                "feeding one MTP layer its own hidden states); 1: Megatron's one step per layer"}),
        ("--enable-draft-training", {**_ON, "help": "train the EAGLE3 draft (--sglang-speculative-draft-model-path) "
                                                  "online on the policy's rollouts; off: the draft stays frozen"}),
        ("--draft-lr", {**_F, "default": None, "help": "the draft's AdamW learning rate (default: --lr)"}),
        ("--draft-ttt-steps", {**_I, "default": 7, "help": "EAGLE3 training-time-test unroll length"}),
    ],
    "model (Megatron MODEL_ARGS; checked against the HF config.json)": [
        *_switches("--swiglu", "--group-query-attention", "--use-rotary-position-embeddings",
                   "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm",
                   "--untie-embeddings-and-output-weights", "--multi-latent-attention",
                   "--moe-router-enable-expert-bias", "--moe-router-pre-softmax", "--moe-grouped-gemm",
                   "--moe-permute-fusion", "--moe-enable-deepep", "--bf16", "--fp16"),
        *_unset(int, "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                     "--num-query-groups", "--kv-channels", "--vocab-size", "--make-vocab-size-divisible-by",
                     "--max-position-embeddings", "--seq-length", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                     "--qk-pos-emb-head-dim", "--v-head-dim", "--num-experts", "--moe-ffn-hidden-size",
                     "--moe-shared-expert-intermediate-size", "--moe-router-topk", "--moe-router-num-groups",
                     "--moe-router-group-topk"),
        *_unset(float, "--rotary-base", "--rotary-percent", "--rotary-scaling-factor", "--norm-epsilon",
                       "--moe-router-bias-update-rate", "--moe-router-topk-scaling-factor", "--moe-aux-loss-coeff"),
        *_unset(str, "--position-embedding-type", "--normalization", "--moe-layer-freq",
                     "--moe-router-score-function", "--moe-router-load-balancing-type", "--moe-router-dtype",
                     "--moe-token-dispatcher-type"),
    ],
    "perf (Megatron PERF_ARGS)": [
        ("--tensor-model-parallel-size", {**_I, "default": 1}),
        ("--sequence-parallel", _ON),
        ("--pipeline-model-parallel-size", {**_I, "default": 1}),
        ("--context-parallel-size", {**_I, "default": 1}),
        ("--expert-model-parallel-size", {**_I, "default": 1}),
        ("--expert-tensor-parallel-size", {**_I, "default": None}),  # Megatron: None = the TP size
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
        ("--config", {"default": None,
                      "help": "YAML file; keys are flag names without dashes; command-line flags win"}),
        ("--rollout-backend", {"default": None, "choices": ["sglang", "embedded"],
                               "help": "default: sglang when a CUDA GPU and a full SGLang are present, else embedded"}),
        ("--rollout-num-engines", {**_I, "default": 1, "help": "engines on machines without GPUs"}),
        ("--metrics-jsonl", {"default": None, "help": "append one JSON object per rollout"}),
        ("--output-dir", {"default": "outputs"}),
        ("--update-weight-buffer-size", {**_I, "default": 512 * 1024**2}),
        ("--weight-sync-transport", {"default": None, "choices": ["distributed", "tensor", "disk"],
                                     "help": "default: distributed when engines are separate, tensor with --colocate"}),
        ("--check-weight-sync", _ON),
        ("--update-weight-transport", {"default": None, "choices": ["nccl", "disk"],
                                       "help": "slime's name: nccl = --weight-sync-transport's default, disk = disk"}),
        ("--check-weight-update-equal", {**_ON, "help": "slime's name of --check-weight-sync"}),
        ("--weight-sync-check-interval", {**_I, "default": 25,
                                          "help": "read back the engines' checksums of every served weight after every "
                                                  "N-th sync (1: every sync); in between only an external draft's own "
                                                  "weights are checked. A failed sync can verify which "
                                                  "engines serve the previous weights only after a checksummed one. "
                                                  "Default from measurement (docs/en/weight-sync.md)"}),
        ("--engine-start-timeout", {**_F, "default": 1800.0,
                                    "help": "upper bound in seconds on an engine server's start-up; the wait goes on "
                                            "only while the process is alive and not yet healthy. Large engines "
                                            "(DeepSeek/GLM at TP8, CUDA graph capture) take well over 300 s"}),
        ("--placement-timeout", {**_F, "default": 300.0,
                                 "help": "seconds to wait for the run's GPU placement group before failing with what "
                                         "was requested and what the cluster has; 0 waits without bound (as slime "
                                         "does: an autoscaling cluster adds nodes for a pending group)"}),
        ("--rollout-request-retries", {**_I, "default": 3,
                                       "help": "resubmissions of a request whose engine died (after its restart)"}),
        ("--spec-speedup-interval", {**_I, "default": None,
                                     "help": "on the first rollout, every N-th and the last, time the same prompts "
                                             "with and without speculation (one speculative engine against a "
                                             "plain engine beside it, same weights) and report spec_speedup = "
                                             "plain time / speculative time; embedded backend only"}),
        ("--spec-speedup-repeats", {**_I, "default": 1,
                                    "help": "with --spec-speedup-interval: time every engine this many times per "
                                            "measurement, in rotating order, and take each engine's median pass "
                                            "(3 rejects one pass slowed by the machine)"}),
        ("--spec-speedup-frozen-draft", {**_ON, "help": "with --spec-speedup-interval and a draft trained online "
                                                        "(--enable-mtp-training / --enable-draft-training): time the "
                                                        "same prompts on a third engine whose draft stays as launched "
                                                        "(target weights current) and report spec_speedup_frozen: what "
                                                        "training the draft online buys, side by side"}),
        ("--allow-unknown-flags", {**_ON, "help": "accept flags slime-spec does not know (your own, mixed in) "
                                                  "instead of stopping; doctor still lists them"}),

        ("--spec-draft-sampling", {**_ON, "help": "embedded engine: MTP/STANDALONE drafts of sampled requests are "
                                                  "sampled from the draft's own distribution and verified with "
                                                  "min(1, p/q) (lossless); SGLang drafts argmax"}),
        ("--spec-auto", {**_ON, "help": "embedded engine: choose the draft length per step (0 = plain) from measured "
                                        "draft/verify costs and the accept rate to maximise tokens/s"}),
    ],
    # slime's function-path extension points: parsed so they are refused by name (NOT_ACTED_ON says what to use).
    "slime extension points (refused; see NOT_ACTED_ON)": [
        (flag, {"default": None}) for flag in (
            "--rollout-function-path", "--eval-function-path", "--data-source-path", "--rollout-sample-hook-path",
            "--custom-rollout-log-function-path", "--custom-eval-rollout-log-function-path", "--buffer-filter-path",
            "--rollout-data-postprocess-path", "--custom-loss-function-path", "--custom-advantage-function-path",
            "--custom-tis-function-path", "--custom-pg-loss-reducer-function-path", "--rm-url",
            "--custom-reward-post-process-path", "--custom-convert-samples-to-train-data-path",
            "--rollout-sample-filter-path", "--rollout-all-samples-process-path", "--custom-model-provider-path",
            "--custom-megatron-init-path", "--custom-megatron-before-log-prob-hook-path",
            "--custom-megatron-before-train-step-hook-path", "--custom-update-weight-post-write-path",
            "--custom-config-path", "--megatron-config-path")
    ],
    **U.GROUPS,
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
        raise KeyError(f"{name!r} is not a flag dest in slime_spec/config/flags.py GROUPS")
    return config_value(name, DEFAULTS[name])


# Flags whose value slime-spec acts on. Every other flag of the table is classified in NOT_ACTED_ON.
ACTED_ON = {
    "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "rollout_num_gpus_per_engine", "colocate",
    "hf_checkpoint", "load", "save", "ref_load", "save_interval",
    "prompt_data", "input_key", "label_key", "apply_chat_template", "rollout_shuffle", "rollout_seed", "rm_type",
    "custom_rm_path", "rm_timeout", "max_consecutive_skipped_steps", "custom_generate_function_path", "num_rollout",
    "rollout_batch_size", "n_samples_per_prompt", "over_sampling_batch_size", "dynamic_sampling_filter_path",
    "rollout_max_response_len", "rollout_max_prompt_len", "rollout_temperature", "rollout_top_p", "rollout_top_k",
    "rollout_stop", "rollout_stop_token_ids", "rollout_skip_special_tokens", "global_batch_size", "micro_batch_size",
    "num_steps_per_rollout",
    "sglang_server_concurrency", "use_sglang_router",
    "rollout_history_drafting", "rollout_history_epochs", "rollout_history_max_tokens",
    "eval_interval", "eval_prompt_data", "eval_temperature", "eval_top_p", "eval_top_k", "eval_max_response_len",
    "n_samples_per_eval_prompt",
    "advantage_estimator", "loss_type", "eps_clip", "eps_clip_high", "eps_clip_c", "use_kl_loss", "kl_loss_coef",
    "kl_loss_type",
    "entropy_coef", "use_tis", "tis_clip", "tis_clip_low", "use_rollout_logprobs", "calculate_per_token_loss",
    "normalize_advantages",
    "disable_rewards_normalization",
    "disable_grpo_std_normalization",
    "optimizer", "lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "seed",
    "use_wandb", "wandb_project", "wandb_group", "wandb_key", "wandb_dir", "wandb_host", "wandb_team", "wandb_mode",
    "wandb_run_id", "offload_rollout", "update_weight_transport", "check_weight_update_equal",
    "skip_eval_before_train",
    "debug_rollout_only", "debug_train_only", "save_debug_rollout_data", "load_debug_rollout_data",
    "mtp_num_layers", "enable_mtp_training", "mtp_loss_scaling_factor", "mtp_unroll_steps",
    "enable_draft_training", "draft_lr", "draft_ttt_steps",
    "tensor_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "max_tokens_per_gpu",
    "pipeline_model_parallel_size", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "context_parallel_size", "use_dynamic_batch_size", "bf16",
    "config", "rollout_backend", "rollout_num_engines", "metrics_jsonl", "output_dir", "update_weight_buffer_size",
    "weight_sync_transport", "check_weight_sync", "weight_sync_check_interval", "engine_start_timeout",
    "rollout_request_retries", "placement_timeout",
    "allow_unknown_flags", "spec_speedup_interval", "spec_speedup_repeats", "spec_speedup_frozen_draft",
    "spec_draft_sampling", "spec_auto",
    # Model-shape flags: the trainer builds the model from config.json; these are checked against it.
    "swiglu", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "kv_channels", "use_rotary_position_embeddings", "rotary_base", "disable_bias_linear",
    "add_qkv_bias", "normalization", "norm_epsilon", "vocab_size", "untie_embeddings_and_output_weights",
    "max_position_embeddings",
}

# Every other flag of the table: what ignoring it means (flags_not_acted_on.py, flags_upstream.py).
NOT_ACTED_ON: dict[str, Ignored] = {**TABLE_NOT_ACTED_ON, **U.NOT_ACTED_ON}


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
