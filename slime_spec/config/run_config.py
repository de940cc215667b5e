"""The typed configuration: built once from the flags by `args.py`, read everywhere else.

Inner code takes the sub-config it needs (`RolloutConfig`, `TrainConfig`, ...), never the
argparse namespace, so it can be built directly in tests. Each field is named after its flag's
dest and takes its default from the flag table (`flags.py`), so a default is written once; the
few values derived from several flags are computed by the `resolve_*` functions below.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

from slime_spec.config.flags import default as flag_default

Backend = Literal["sglang", "embedded"]
Transport = Literal["distributed", "tensor", "disk"]
LossType = Literal["policy_loss", "sft"]


def in_flight_per_engine(rollout: "RolloutConfig", engines: int) -> int:
    """The most requests the rollout keeps in flight on one engine: a rollout's samples spread over the engines, each
    engine holding at most --sglang-server-concurrency (a count below 1 is refused by the flag checks)."""
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    return min(rollout.sglang_server_concurrency, -(-samples // max(1, engines)))


def resolve_global_batch_size(global_batch_size: int | None, rollout_batch_size: int, n_samples_per_prompt: int,
                              num_steps_per_rollout: int | None = None) -> int:
    """--global-batch-size, else a rollout's samples over --num-steps-per-rollout optimizer steps (one by default),
    as slime does (doctor checks that the two agree where both are given)."""
    if global_batch_size:
        return global_batch_size
    return rollout_batch_size * n_samples_per_prompt // (num_steps_per_rollout or 1)


def resolve_transport(weight_sync_transport: str | None, colocate: bool) -> Transport:
    """--weight-sync-transport, else tensor when colocated and distributed when engines are separate."""
    if weight_sync_transport is None:
        return "tensor" if colocate else "distributed"
    if weight_sync_transport not in ("distributed", "tensor", "disk"):
        raise ValueError(f"--weight-sync-transport {weight_sync_transport!r}: choose distributed, tensor or disk")
    return weight_sync_transport  # type: ignore[return-value]


def resolve_rollout_gpus(rollout_num_gpus: int | None, colocate: bool, actor_gpus: int, backend: str) -> int | None:
    """--rollout-num-gpus, else with --colocate on SGLang every actor GPU (one engine per
    --rollout-num-gpus-per-engine of them), as slime does."""
    if rollout_num_gpus is None and colocate and backend == "sglang":
        return actor_gpus
    return rollout_num_gpus


def colocated_engine_flags(server_args: dict, offload_rollout: bool | None) -> list[str]:
    """SGLang server flags slime turns on for colocated engines, unless the user set them: the memory saver
    (so release_memory_occupation frees the GPU for the trainer; off with --no-offload-rollout), the draft's
    weights kept on the CPU across a release (else they may not survive a release/resume cycle), and, with
    the memory saver, no prefill CUDA graphs (slime: SGLang's default breakable prefill graphs do not work with
    the memory saver)."""
    flags: list[str] = []
    memory_saver = server_args.get("enable_memory_saver")
    if memory_saver is None and offload_rollout is not False:
        flags.append("--enable-memory-saver")
        memory_saver = True
    if server_args.get("enable_draft_weights_cpu_backup") is None:
        flags.append("--enable-draft-weights-cpu-backup")
    if memory_saver and server_args.get("cuda_graph_backend_prefill") is None \
            and not server_args.get("disable_prefill_cuda_graph"):
        flags += ["--cuda-graph-backend-prefill", "disabled"]
    return flags


def expert_tensor_parallel_size(tp: int, etp: int | None) -> int:
    """--expert-tensor-parallel-size as Megatron resolves it: unset, the TP size."""
    return tp if etp is None else etp


def moe_expert_layout_refusal(tp: int, ep: int, etp: int | None) -> str | None:
    """Why the trainer does not build this layout of a MoE model's experts (a sentence), or None.

    Built: experts split over the TP ranks without expert parallelism (expert TP = TP, EP 1); expert parallelism
    with whole experts (expert TP 1) at an EP size that is a multiple of the TP size (megatron-core's folding:
    attention over TP, experts over EP, on the same ranks). Each checked against one rank
    (tests/test_trainer_tp.py, tests/test_trainer_ep.py)."""
    etp = expert_tensor_parallel_size(tp, etp)
    if etp == tp and (ep == 1 or tp == 1):
        return None
    if etp == 1 and ep > 1 and ep % tp == 0:
        return None
    if etp == 1 and ep > 1:  # each EP group must hold whole TP groups, for the gather of the weights to sync
        return (f"--expert-model-parallel-size {ep} with whole experts at --tensor-model-parallel-size {tp} is built "
                f"with the EP size a multiple of the TP size; use --expert-model-parallel-size "
                f"{tp * ((ep + tp - 1) // tp)}")
    if etp == 1:
        return (f"--expert-tensor-parallel-size 1 at --tensor-model-parallel-size {tp} without expert parallelism "
                f"replicates every expert over the TP ranks, which is not built; leave --expert-tensor-parallel-size "
                f"unset (experts split over TP) or split the experts with --expert-model-parallel-size")
    if etp != tp:
        return (f"--expert-tensor-parallel-size {etp} is built as 1 or as --tensor-model-parallel-size ({tp}) "
                f"only")
    return (f"--tensor-model-parallel-size {tp} with --expert-model-parallel-size {ep} splits each expert over the "
            f"TP ranks too (--expert-tensor-parallel-size unset = {tp}), which is not built with expert parallelism; "
            f"add --expert-tensor-parallel-size 1 (whole experts, as slime's MoE scripts run)")


def resolve_loss_type(loss_type: str) -> LossType:
    """--loss-type as the trainer reads it: slime's sft_loss is the trainer's sft."""
    return "sft" if loss_type in ("sft", "sft_loss") else "policy_loss"


@dataclass(frozen=True)
class ClusterConfig:
    actor_num_nodes: int = flag_default("actor_num_nodes")
    actor_num_gpus_per_node: int = flag_default("actor_num_gpus_per_node")
    rollout_num_gpus: int | None = flag_default("rollout_num_gpus")
    rollout_num_gpus_per_engine: int = flag_default("rollout_num_gpus_per_engine")
    rollout_num_engines: int = flag_default("rollout_num_engines")  # used when there are no GPUs
    colocate: bool = flag_default("colocate")
    placement_timeout: float = flag_default("placement_timeout")  # seconds; 0 = no bound


@dataclass(frozen=True)
class EngineConfig:
    """How to start one engine's server process: backend, model and forwarded SGLang flags."""

    backend: Backend
    model_path: str
    num_gpus_per_engine: int = flag_default("rollout_num_gpus_per_engine")
    # `--sglang-X ...` tokens with the prefix stripped, in the order the user wrote them.
    forwarded_argv: tuple[str, ...] = ()
    # The same flags parsed by SGLang's own parser: dest -> value (only those the user set).
    server_args: dict = field(default_factory=dict)
    seed: int = flag_default("seed")
    spec_draft_sampling: bool = flag_default("spec_draft_sampling")  # ours; embedded backend only
    spec_auto: bool = flag_default("spec_auto")                      # ours; embedded backend only
    # The most requests the rollout keeps in flight on one engine (min of --sglang-server-concurrency and a
    # rollout's samples over the engines): a plain embedded engine without --sglang-max-running-requests runs that
    # many at once
    in_flight_per_engine: int | None = None

    @property
    def module(self) -> str:
        return "sglang.launch_server" if self.backend == "sglang" else "slime_spec.engine"

    def server_argv(self, host: str, port: int, base_gpu_id: int = 0, python: str | None = None,
                    engine_index: int = 0) -> list[str]:
        """The exact command line of one engine's server process.

        As slime launches SGLang: `--trust-remote-code` always (MiMo's config class ships with the checkpoint),
        tp = GPUs per engine / `--sglang-pp-size`, and each engine its own seed (seed + engine index).
        """
        pp_size = int(self.server_args.get("pp_size") or 1)
        if pp_size < 1 or self.num_gpus_per_engine % pp_size:
            raise ValueError(f"--rollout-num-gpus-per-engine {self.num_gpus_per_engine} is not divisible by "
                             f"--sglang-pp-size {pp_size}: each engine runs tp x pp GPUs; set "
                             f"--rollout-num-gpus-per-engine to a multiple of {pp_size}")
        argv = [python or sys.executable, "-m", self.module, "--model-path", self.model_path]
        if self.backend == "sglang":
            argv += ["--trust-remote-code"]
        argv += ["--host", host, "--port", str(port),
                 "--tp-size", str(self.num_gpus_per_engine // pp_size),
                 "--random-seed", str(self.seed + engine_index)]
        if self.backend == "sglang":
            argv += ["--base-gpu-id", str(base_gpu_id)]
        own = [flag for flag, on in (("--spec-draft-sampling", self.spec_draft_sampling),
                                     ("--spec-auto", self.spec_auto)) if on and self.backend == "embedded"]
        return argv + list(self.forwarded_argv) + own + self.embedded_running_argv()

    def embedded_running_argv(self) -> list[str]:
        """`--max-running-requests` for a plain embedded engine the user gave none: SGLang, unset, runs every
        request its paged KV pool holds (at least 2048 where it holds them), so a rollout's whole batch decodes at
        once; the embedded engine's static cache holds `--max-running-requests` slots (default 32), so it is sized
        to what the rollout sends. With speculation SGLang's own default (48) applies, as on SGLang."""
        if (self.backend != "embedded" or not self.in_flight_per_engine or "max_running_requests" in self.server_args
                or self.server_args.get("speculative_algorithm")):
            return []
        return ["--max-running-requests", str(self.in_flight_per_engine)]


@dataclass(frozen=True)
class RolloutConfig:
    hf_checkpoint: str
    prompt_data: str | None = flag_default("prompt_data")
    input_key: str = flag_default("input_key")
    label_key: str | None = flag_default("label_key")
    apply_chat_template: bool = flag_default("apply_chat_template")
    rollout_shuffle: bool = flag_default("rollout_shuffle")
    rollout_seed: int = flag_default("rollout_seed")
    rm_type: str | None = flag_default("rm_type")
    custom_rm_path: str | None = flag_default("custom_rm_path")
    rm_timeout: float | None = flag_default("rm_timeout")  # seconds per sample (rollout/reward_runner.py)
    custom_generate_function_path: str | None = flag_default("custom_generate_function_path")
    num_rollout: int = flag_default("num_rollout")
    rollout_batch_size: int = flag_default("rollout_batch_size")
    n_samples_per_prompt: int = flag_default("n_samples_per_prompt")
    # dynamic sampling (rollout/dynamic_sampling.py): prompts submitted at a time, and the group filter
    over_sampling_batch_size: int | None = flag_default("over_sampling_batch_size")
    dynamic_sampling_filter_path: str | None = flag_default("dynamic_sampling_filter_path")
    rollout_max_response_len: int = flag_default("rollout_max_response_len")
    rollout_max_prompt_len: int | None = flag_default("rollout_max_prompt_len")
    rollout_temperature: float = flag_default("rollout_temperature")
    rollout_top_p: float = flag_default("rollout_top_p")
    rollout_top_k: int = flag_default("rollout_top_k")
    rollout_stop: tuple[str, ...] = flag_default("rollout_stop")
    rollout_stop_token_ids: tuple[int, ...] = flag_default("rollout_stop_token_ids")
    rollout_skip_special_tokens: bool = flag_default("rollout_skip_special_tokens")
    # Each --eval-* flag falls back to its rollout flag.
    eval_temperature: float | None = flag_default("eval_temperature")
    eval_top_p: float | None = flag_default("eval_top_p")
    eval_top_k: int | None = flag_default("eval_top_k")
    eval_max_response_len: int | None = flag_default("eval_max_response_len")
    n_samples_per_eval_prompt: int = flag_default("n_samples_per_eval_prompt")
    sglang_server_concurrency: int = flag_default("sglang_server_concurrency")  # in-flight requests per engine
    use_sglang_router: bool = flag_default("use_sglang_router")
    save_debug_rollout_data: str | None = flag_default("save_debug_rollout_data")
    load_debug_rollout_data: str | None = flag_default("load_debug_rollout_data")
    metrics_jsonl: str | None = flag_default("metrics_jsonl")
    engine_start_timeout: float = flag_default("engine_start_timeout")  # seconds
    rollout_request_retries: int = flag_default("rollout_request_retries")
    rollout_history_drafting: bool = flag_default("rollout_history_drafting")
    rollout_history_epochs: int = flag_default("rollout_history_epochs")
    rollout_history_max_tokens: int = flag_default("rollout_history_max_tokens")


@dataclass(frozen=True)
class TrainConfig:
    hf_checkpoint: str
    load: str | None = flag_default("load")
    save: str | None = flag_default("save")
    ref_load: str | None = flag_default("ref_load")
    save_interval: int | None = flag_default("save_interval")
    loss_type: LossType = resolve_loss_type(flag_default("loss_type"))
    advantage_estimator: str = flag_default("advantage_estimator")
    n_samples_per_prompt: int = flag_default("n_samples_per_prompt")
    eps_clip: float = flag_default("eps_clip")
    eps_clip_high: float | None = flag_default("eps_clip_high")
    eps_clip_c: float | None = flag_default("eps_clip_c")  # dual-clip PPO's bound for negative advantages
    use_kl_loss: bool = flag_default("use_kl_loss")
    kl_loss_coef: float = flag_default("kl_loss_coef")
    kl_loss_type: str = flag_default("kl_loss_type")
    entropy_coef: float = flag_default("entropy_coef")
    # slime's reward post-processing: raw rewards as advantages, or centred on the group mean without its std
    disable_rewards_normalization: bool = flag_default("disable_rewards_normalization")
    disable_grpo_std_normalization: bool = flag_default("disable_grpo_std_normalization")
    # slime's whitening of the rollout's advantages over every trained token, after GRPO's per-group normalization
    normalize_advantages: bool = flag_default("normalize_advantages")
    # slime's truncated importance sampling: each token's policy loss weighted by exp(old - rollout log-prob)
    use_tis: bool = flag_default("use_tis")
    tis_clip: float = flag_default("tis_clip")
    tis_clip_low: float = flag_default("tis_clip_low")
    # slime's importance ratios against the engine's log-probs: no old-policy forward before the update
    use_rollout_logprobs: bool = flag_default("use_rollout_logprobs")
    # slime's token-level loss: every trained token of an optimizer step weighs the same, not every sample
    calculate_per_token_loss: bool = flag_default("calculate_per_token_loss")
    # the trainer's log-probs are of the distribution the engine sampled from (slime divides logits by it)
    rollout_temperature: float = flag_default("rollout_temperature")
    lr: float = flag_default("lr")
    weight_decay: float = flag_default("weight_decay")
    adam_beta1: float = flag_default("adam_beta1")
    adam_beta2: float = flag_default("adam_beta2")
    adam_eps: float = flag_default("adam_eps")
    clip_grad: float = flag_default("clip_grad")
    max_consecutive_skipped_steps: int = flag_default("max_consecutive_skipped_steps")  # trainer/finite_guard.py
    global_batch_size: int = resolve_global_batch_size(flag_default("global_batch_size"),
                                                       flag_default("rollout_batch_size"),
                                                       flag_default("n_samples_per_prompt"))
    micro_batch_size: int = flag_default("micro_batch_size")
    # Packed micro-batches of at most this many tokens (replaces micro_batch_size); None: padded, by samples.
    max_tokens_per_gpu: int | None = flag_default("max_tokens_per_gpu")
    use_dynamic_batch_size: bool = flag_default("use_dynamic_batch_size")  # slime's switch; needs the above
    bf16: bool = flag_default("bf16")  # bfloat16 model, float32 master weights in the optimizer
    mtp_num_layers: int = flag_default("mtp_num_layers")
    enable_mtp_training: bool = flag_default("enable_mtp_training")
    mtp_loss_scaling_factor: float = flag_default("mtp_loss_scaling_factor")
    mtp_unroll_steps: int = flag_default("mtp_unroll_steps")  # ours: the last MTP layer trained on its own outputs
    enable_draft_training: bool = flag_default("enable_draft_training")  # online EAGLE3 draft (eagle3_online.py)
    draft_lr: float | None = flag_default("draft_lr")
    draft_ttt_steps: int = flag_default("draft_ttt_steps")
    tensor_model_parallel_size: int = flag_default("tensor_model_parallel_size")
    expert_model_parallel_size: int = flag_default("expert_model_parallel_size")  # MoE experts split over ranks
    # each routed expert split over this many ranks; None: the TP size (Megatron's default)
    expert_tensor_parallel_size: int | None = flag_default("expert_tensor_parallel_size")
    # pipeline stages (megatron-core's schedules); None: the decoder layers split evenly, else the first / last
    # stage holds that many and the others split the rest evenly
    pipeline_model_parallel_size: int = flag_default("pipeline_model_parallel_size")
    decoder_first_pipeline_num_layers: int | None = flag_default("decoder_first_pipeline_num_layers")
    decoder_last_pipeline_num_layers: int | None = flag_default("decoder_last_pipeline_num_layers")
    # each sequence split over this many ranks (two load-balanced chunks each, as Megatron lays them out)
    context_parallel_size: int = flag_default("context_parallel_size")
    seed: int = flag_default("seed")


@dataclass(frozen=True)
class WeightSyncConfig:
    weight_sync_transport: Transport = resolve_transport(flag_default("weight_sync_transport"),
                                                         flag_default("colocate"))
    update_weight_buffer_size: int = flag_default("update_weight_buffer_size")
    check_weight_sync: bool = flag_default("check_weight_sync")
    weight_sync_check_interval: int = flag_default("weight_sync_check_interval")


@dataclass(frozen=True)
class WandbConfig:
    use_wandb: bool = flag_default("use_wandb")
    wandb_project: str | None = flag_default("wandb_project")
    wandb_group: str | None = flag_default("wandb_group")
    wandb_key: str | None = flag_default("wandb_key")
    wandb_dir: str | None = flag_default("wandb_dir")
    wandb_host: str | None = flag_default("wandb_host")
    wandb_team: str | None = flag_default("wandb_team")
    wandb_mode: str | None = flag_default("wandb_mode")
    wandb_run_id: str | None = flag_default("wandb_run_id")


@dataclass(frozen=True)
class Config:
    cluster: ClusterConfig
    engine: EngineConfig
    rollout: RolloutConfig
    train: TrainConfig
    weight_sync: WeightSyncConfig
    wandb: WandbConfig
    debug_rollout_only: bool = flag_default("debug_rollout_only")
    debug_train_only: bool = flag_default("debug_train_only")
    eval_interval: int | None = flag_default("eval_interval")
    eval_prompt_data: tuple[str, ...] = flag_default("eval_prompt_data")
    output_dir: str = flag_default("output_dir")
    spec_speedup_interval: int | None = flag_default("spec_speedup_interval")  # see speculative/speedup.py
    spec_speedup_repeats: int = flag_default("spec_speedup_repeats")
    spec_speedup_frozen_draft: bool = flag_default("spec_speedup_frozen_draft")
    skip_eval_before_train: bool = flag_default("skip_eval_before_train")  # slime's: no eval at rollout 0

    @property
    def num_engines(self) -> int:
        c = self.cluster
        if self.engine.backend == "sglang" and c.rollout_num_gpus:
            return max(1, c.rollout_num_gpus // c.rollout_num_gpus_per_engine)
        return c.rollout_num_engines
