"""slime's and Megatron's flags that slime-spec parses but does not act on, each with what ignoring it means.

A slime run script passes slime's own flags (slime/utils/arguments.py) and the Megatron-LM flags of its
MODEL_ARGS / PERF_ARGS. slime-spec parses every one of them, so a script runs unchanged, and says for each
flag it does not act on either why it changes nothing here (doctor: info, grouped by reason) or why it
would change the run (doctor: FLAG_NOT_SUPPORTED, with a fix). `flags.py` merges `GROUPS` and
`NOT_ACTED_ON` into its own tables.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Ignored:
    """A parsed flag slime-spec does not act on, and what ignoring it means.

    A value in `accepted` (every value when `accepted` is None) changes nothing here: doctor reports it
    as info with `why`. Any other value would silently change what the user gets: doctor refuses it
    (FLAG_NOT_SUPPORTED) with `why` and `fix`, unless `covered_by(namespace)` says the other flags already
    get what this flag asks (doctor: info with `covered_why`). `trainer_only` flags mean nothing with
    --debug-rollout-only.
    """

    why: str
    fix: str = ""
    accepted: tuple | None = None
    trainer_only: bool = False
    covered_by: Callable[[argparse.Namespace], bool] | None = None
    covered_why: str = ""

    def refuses(self, value) -> bool:
        return self.accepted is not None and value not in self.accepted


def refused(why: str, fix: str, accepted: tuple = (None, False), trainer_only: bool = False) -> Ignored:
    return Ignored(why, fix, accepted, trainer_only)


def trainer(why: str, fix: str, accepted: tuple = (None, False)) -> Ignored:
    return Ignored(why, fix, accepted, trainer_only=True)


FROM_CONFIG_JSON = Ignored("the trainer builds the model from --hf-checkpoint's config.json")
MEGATRON_PERF = Ignored("a Megatron memory/speed knob: it does not change the update, and the trainer here does "
                        "not implement it")
PROFILING = Ignored("a slime profiling/debugging knob; slime-spec does not profile")
LOGGING = Ignored("a slime logging option; slime-spec logs --metrics-jsonl and wandb (docs/en/usage.md)")
CI_ONLY = Ignored("slime's own CI assertions")
EXTENSION_FIX = "drop it; slime-spec has no such hook"
_ON = {"action": "store_true"}
_I, _F = {"type": int}, {"type": float}
_JSON = {"type": json.loads, "default": None}
_ENGINE_WATCH = Ignored("engines are watched and restarted by slime-spec's own liveness checks "
                        "(--rollout-request-retries)")
_WEIGHT_SYNC_DISK = Ignored("a setting of slime's disk/delta weight sync; here --weight-sync-transport chooses "
                            "how weights travel")

# (flag, argparse kwargs, what ignoring it means), by slime's own grouping.
_TABLE: dict[str, list[tuple[str, dict, Ignored]]] = {
    "slime: cluster and weight sync (not acted on)": [
        ("--train-backend", {"default": None, "choices": ["megatron"]},
         Ignored("the trainer here is the only backend (Megatron-core layers)")),
        ("--num-gpus-per-node", {**_I, "default": None},
         Ignored("engines are placed by Ray placement groups on the GPUs each node has")),
        ("--offload-train", {"action": argparse.BooleanOptionalAction, "default": None},
         Ignored("the trainer keeps its weights on the GPU; with --colocate the engines release theirs while it "
                 "trains")),
        ("--distributed-backend", {"default": None},
         Ignored("torch.distributed uses NCCL on GPUs and gloo on CPUs here")),
        ("--distributed-timeout-minutes", {**_I, "default": None},
         Ignored("process-group timeouts are set by slime-spec")),
        ("--train-env-vars", _JSON,
         refused("environment variables are not passed to the training actors",
                 "set them in the job's environment (ray job submit --runtime-env-json '{\"env_vars\": ...}')",
                 accepted=(None, {}))),
        ("--update-weight-mode", {"default": None, "choices": ["full", "delta"]},
         refused("every sync sends the full weights", "--update-weight-mode full", accepted=(None, "full"))),
        ("--release-train", _ON,
         refused("training actors stay up between rollouts", "drop --release-train")),
        ("--update-weight-disk-dir", {"default": None}, _WEIGHT_SYNC_DISK),
        ("--update-weight-disk-keep-files", _ON, _WEIGHT_SYNC_DISK),
        ("--update-weight-delta-encoding", {"default": None, "choices": ["xor", "overwrite"]}, _WEIGHT_SYNC_DISK),
        ("--update-weight-delta-checksum", {"default": None, "choices": ["xxh3-128", "blake3", "adler32"]},
         _WEIGHT_SYNC_DISK),
        ("--update-weight-local-checkpoint-dir", {"default": None}, _WEIGHT_SYNC_DISK),
        ("--update-weights-interval", {**_I, "default": None},
         refused("the engines get the new weights after every training step", "--update-weights-interval 1",
                 accepted=(None, 1))),
        ("--keep-old-actor", _ON,
         trainer("no second copy of the policy is kept for rollout log-probs", "drop --keep-old-actor")),
        ("--rollout-data-transport", {"default": None, "choices": ["object-store", "nixl"]},
         Ignored("rollout data reaches the trainer through Ray's object store")),
        ("--rollout-external-engine-addrs", {"nargs": "+", "default": None},
         refused("engines are started by slime-spec", "drop it; --rollout-num-gpus places the engines")),
        ("--use-fault-tolerance", _ON, _ENGINE_WATCH),
        ("--rollout-health-check-interval", {**_F, "default": None}, _ENGINE_WATCH),
        ("--rollout-health-check-timeout", {**_F, "default": None}, _ENGINE_WATCH),
        ("--rollout-health-check-first-wait", {**_F, "default": None}, _ENGINE_WATCH),
        ("--http-proxy", {"default": None}, Ignored("engines are reached directly")),
        ("--use-distributed-post", _ON, Ignored("requests go from the rollout manager to each engine directly")),
        ("--prefill-num-servers", {**_I, "default": None},
         refused("prefill/decode disaggregation is not implemented", "drop --prefill-num-servers")),
    ],
    "slime: data and rollout (not acted on)": [
        ("--rollout-max-context-len", {**_I, "default": None},
         refused("the context is bounded by --rollout-max-prompt-len and --rollout-max-response-len",
                 "--rollout-max-prompt-len P --rollout-max-response-len R with P + R <= the context")),
        ("--mask-offpolicy-in-partial-rollout", _ON,
         Ignored("only with --partial-rollout, which is refused")),
        ("--disable-rollout-global-dataset", _ON,
         refused("prompts always come from the one --prompt-data dataset", "drop it")),
        ("--apply-chat-template-kwargs", _JSON,
         refused("the chat template is applied with its defaults", "drop it, or put the template's choices in the "
                 "prompts of --prompt-data", accepted=(None, {}))),
        ("--multimodal-keys", _JSON, refused("prompts are text only", "drop it")),
        ("--tool-key", {"default": None},
         refused("tools in the prompt data are not passed to the chat template", "drop it",
                 accepted=(None, "tools"))),
        ("--start-rollout-id", {**_I, "default": None},
         trainer("a run resumes at the rollout --load holds, else at 0", "drop it; resume with --load")),
        ("--eval-config", {"default": None},
         refused("eval sets come from --eval-prompt-data", "--eval-prompt-data NAME FILE [NAME FILE ...]")),
        ("--eval-input-key", {"default": None},
         refused("eval prompts are read with --input-key", "drop it, or name the field as in --prompt-data")),
        ("--eval-label-key", {"default": None},
         refused("eval labels are read with --label-key", "drop it, or name the field as in --prompt-data")),
        ("--eval-tool-key", {"default": None}, refused("tools are not passed to the chat template", "drop it")),
        ("--eval-max-prompt-len", {**_I, "default": None},
         refused("eval prompts are filtered by --rollout-max-prompt-len", "drop it")),
        ("--eval-min-new-tokens", {**_I, "default": None},
         refused("generation has no minimum length here", "drop it")),
        ("--eval-max-context-len", {**_I, "default": None},
         refused("the eval context is bounded by the prompt and --eval-max-response-len",
                 "--eval-max-response-len")),
        ("--reward-key", {"default": None},
         refused("reward functions return one float here", "return the float from --custom-rm-path")),
        ("--eval-reward-key", {"default": None},
         refused("reward functions return one float here", "return the float from --custom-rm-path")),
        ("--group-rm", _ON,
         refused("rewards are computed per sample", "drop --group-rm; --custom-rm-path scores one sample")),
        ("--rollout-buffer-url", {"default": None},
         Ignored("only read by slime's agent rollout functions, which are refused as --rollout-function-path")),
        ("--fetch-trajectory-retry-times", {**_I, "default": None},
         Ignored("only read by slime's agent rollout functions, which are refused as --rollout-function-path")),
        ("--min-batch-collection-ratio", {**_F, "default": None},
         Ignored("only read by slime's agent rollout functions, which are refused as --rollout-function-path")),
        ("--rollout-task-type", {"default": None},
         Ignored("only read by slime's agent rollout functions, which are refused as --rollout-function-path")),
        ("--load-forge-rollout-data", {"default": None},
         refused("slime's rollout dumps are not read", "--load-debug-rollout-data with a slime-spec dump")),
        ("--load-debug-rollout-data-subsample", {**_F, "default": None},
         refused("a debug rollout is replayed whole", "drop it")),
    ],
    "slime: algorithm (not acted on)": [
        ("--num-critic-only-steps", {**_I, "default": None},
         trainer("PPO's critic is not implemented", "drop it", accepted=(None, 0))),
        ("--value-clip", {**_F, "default": None}, Ignored("PPO's critic is not implemented")),
        ("--gamma", {**_F, "default": None},
         trainer("GAE is not implemented (GRPO advantages are per sequence)", "drop it", accepted=(None, 1.0))),
        ("--lambd", {**_F, "default": None},
         trainer("GAE is not implemented (GRPO advantages are per sequence)", "drop it", accepted=(None, 1.0))),
        ("--disable-compute-advantages-and-returns", _ON,
         trainer("advantages are always computed", "drop it")),
        ("--use-unbiased-kl", _ON, trainer("the KL loss uses --kl-loss-type as written", "drop it")),
        ("--ref-update-interval", {**_I, "default": None},
         trainer("the reference model stays as loaded", "drop it")),
        ("--use-rollout-entropy", _ON, Ignored("only an input to custom loss masks, which are refused")),
        ("--get-mismatch-metrics", _ON,
         Ignored("the train/rollout log-prob gap is reported as train_rollout_logprob_abs_diff whenever the "
                 "engines return log-probs")),
        ("--reset-optimizer-states", _ON, trainer("the optimizer keeps its state across rollouts", "drop it")),
        ("--use-stateless-adam", _ON, trainer("Adam keeps its moments", "drop it")),
        ("--use-routing-replay", _ON,
         trainer("MoE routing replay is not implemented: the trainer routes every token itself", "drop it")),
        ("--use-rollout-routing-replay", _ON,
         trainer("MoE routing replay is not implemented: the trainer routes every token itself", "drop it")),
        ("--use-opsm", _ON, trainer("off-policy sequence masking is not implemented", "drop --use-opsm")),
        ("--opsm-delta", {**_F, "default": None}, Ignored("only with --use-opsm, which is refused")),
        ("--use-opd", _ON, trainer("on-policy distillation is not implemented", "drop --use-opd")),
        ("--opd-type", {"default": None, "choices": ["sglang", "megatron"]},
         Ignored("only with --use-opd, which is refused")),
        ("--opd-kl-coef", {**_F, "default": None}, Ignored("only with --use-opd, which is refused")),
        ("--opd-teacher-load", {"default": None}, Ignored("only with --use-opd, which is refused")),
        ("--opd-teacher-ckpt-step", {**_I, "default": None}, Ignored("only with --use-opd, which is refused")),
        ("--loss-mask-type", {"default": None},
         Ignored("the loss covers the response tokens the engines generated (no template parsing)")),
        ("--only-train-params-name-list", {"nargs": "*", "default": None},
         trainer("every parameter is trained", "drop it")),
        ("--freeze-params-name-list", {"nargs": "*", "default": None},
         trainer("every parameter is trained", "drop it")),
        ("--freeze-indexer", _ON, Ignored("DSA indexers are not built here")),
    ],
    "slime: checkpoints, logging and debugging (not acted on)": [
        ("--ref-ckpt-step", {**_I, "default": None},
         trainer("the reference model is --ref-load's latest checkpoint, else --hf-checkpoint", "drop it")),
        ("--async-save", _ON, Ignored("checkpoints are saved synchronously; they hold the same state")),
        ("--no-save-optim", _ON,
         Ignored("checkpoints hold the optimizer state too (larger; a run resumes from them)")),
        ("--save-hf", {"default": None},
         trainer("checkpoints are written in slime-spec's own format", "drop it")),
        ("--padded-vocab-size", {**_I, "default": None}, FROM_CONFIG_JSON),
        ("--model-name", {"default": None}, FROM_CONFIG_JSON),
        ("--qwen-gdn-backend", {"default": None}, Ignored("linear-attention (GDN) layers are not built here")),
        ("--recompute-loss-function", _ON, MEGATRON_PERF),
        ("--log-probs-chunk-size", {**_I, "default": None}, MEGATRON_PERF),
        ("--log-probs-max-tokens-per-gpu", {**_I, "default": None}, MEGATRON_PERF),
        ("--balance-by-flops", _ON,
         trainer("micro-batches are packed by tokens (first fit), not by estimated FLOPs", "drop it")),
        ("--data-pad-size-multiplier", {**_I, "default": None}, MEGATRON_PERF),
        ("--disable-wandb-random-suffix", _ON, LOGGING),
        ("--wandb-always-use-train-step", _ON, LOGGING),
        ("--log-multi-turn", _ON, LOGGING),
        ("--log-passrate", _ON, LOGGING),
        ("--log-reward-category", {"default": None}, LOGGING),
        ("--log-correct-samples", _ON, LOGGING),
        ("--use-tensorboard", _ON, LOGGING),
        ("--tb-project-name", {"default": None}, LOGGING),
        ("--tb-experiment-name", {"default": None}, LOGGING),
        ("--save-debug-train-data", {"default": None}, PROFILING),
        ("--dump-details", {"default": None},
         refused("slime's detail dumps are not written", "--save-debug-rollout-data <file> for the rollouts")),
        ("--memory-snapshot-dir", {"default": None}, PROFILING),
        ("--memory-snapshot-num-steps", {**_I, "default": None}, PROFILING),
        ("--profile-target", {"nargs": "+", "default": None}, PROFILING),
        ("--memory-recorder", {"default": None}, PROFILING),
        ("--record-memory-history", _ON, PROFILING),
        ("--megatron-deepgemm-forward-layers", {"nargs": "+", "type": int, "default": None},
         trainer("the trainer computes in bfloat16/float32, with no FP8 forward", "drop it")),
        ("--megatron-deepgemm-forward-modules", {"nargs": "+", "default": None},
         Ignored("only with --megatron-deepgemm-forward-layers, which is refused")),
        ("--megatron-deepgemm-moe-forward-layers", {"nargs": "+", "type": int, "default": None},
         trainer("the trainer computes in bfloat16/float32, with no FP8 forward", "drop it")),
        ("--megatron-deepgemm-moe-forward-modules", {"nargs": "+", "default": None},
         Ignored("only with --megatron-deepgemm-moe-forward-layers, which is refused")),
        ("--ci-test", _ON, CI_ONLY),
        ("--ci-disable-kl-checker", _ON, CI_ONLY),
        ("--ci-train-rollout-logprob-abs-diff-threshold", {**_F, "default": None}, CI_ONLY),
        ("--ci-save-grad-norm", {"default": None}, CI_ONLY),
        ("--ci-load-grad-norm", {"default": None}, CI_ONLY),
    ],
    "Megatron flags of slime's MODEL_ARGS and PERF_ARGS (not acted on)": [
        ("--spec", {"nargs": 2, "default": None}, FROM_CONFIG_JSON),
        ("--no-position-embedding", _ON, FROM_CONFIG_JSON),
        ("--rotary-interleaved", _ON, FROM_CONFIG_JSON),
        ("--use-rope-scaling", _ON, FROM_CONFIG_JSON),
        ("--mscale", {**_F, "default": None}, FROM_CONFIG_JSON),
        ("--mscale-all-dim", {**_F, "default": None}, FROM_CONFIG_JSON),
        ("--apply-layernorm-1p", _ON, FROM_CONFIG_JSON),
        ("--post-self-attn-layernorm", _ON, FROM_CONFIG_JSON),
        ("--post-mlp-layernorm", _ON, FROM_CONFIG_JSON),
        ("--use-gated-attention", _ON, FROM_CONFIG_JSON),
        ("--attention-output-gate", _ON, FROM_CONFIG_JSON),
        ("--moe-shared-expert-gate", _ON, FROM_CONFIG_JSON),
        ("--moe-token-drop-policy", {"default": None}, FROM_CONFIG_JSON),
        ("--enable-experimental", _ON, Ignored("enables Megatron's experimental features, none of which run here")),
        ("--allgather-cp", _ON, Ignored(
            "slime lays sequences out in contiguous context-parallel chunks with it, for DSA attention models only "
            "(DeepSeek-V3.2, GLM-5.1), which the trainer does not build (slime refuses it for other models)",
            "drop --allgather-cp: the trainer lays each sequence out in Megatron's load-balanced chunks, slime's "
            "default", accepted=(None, False), trainer_only=True,
            covered_by=lambda ns: (ns.context_parallel_size or 1) <= 1,
            covered_why="no effect at --context-parallel-size 1")),
        ("--no-rope-fusion", _ON, MEGATRON_PERF),
        ("--no-masked-softmax-fusion", _ON, MEGATRON_PERF),
        ("--no-gradient-accumulation-fusion", _ON, MEGATRON_PERF),
        ("--no-check-for-nan-in-loss-and-grad", _ON,
         Ignored("Megatron's NaN check; slime-spec keeps a non-finite loss or gradient out of the weights on its "
                 "own (trainer/finite_guard.py)")),
        ("--deterministic-mode", _ON,
         trainer("deterministic kernels are not enforced here", "drop --deterministic-mode")),
        ("--lr-warmup-fraction", {**_F, "default": None},
         trainer("the learning rate has no warm-up", "drop it", accepted=(None, 0.0))),
    ],
}

GROUPS: dict[str, list[tuple[str, dict]]] = {g: [(f, kw) for f, kw, _ in rows] for g, rows in _TABLE.items()}
NOT_ACTED_ON: dict[str, Ignored] = {f.removeprefix("--").replace("-", "_"): why
                                    for rows in _TABLE.values() for f, _, why in rows}
