"""The typed configuration: built once from the flags by `args.py`, read everywhere else.

Inner code takes the sub-config it needs (`RolloutConfig`, `TrainConfig`, ...), never the
argparse namespace, so it can be built directly in tests.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

Backend = Literal["sglang", "embedded"]


@dataclass(frozen=True)
class ClusterConfig:
    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1
    rollout_num_gpus: int | None = None
    rollout_num_gpus_per_engine: int = 1
    rollout_num_engines: int = 1  # used when there are no GPUs
    colocate: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """How to start one engine's server process: backend, model and forwarded SGLang flags."""

    backend: Backend
    model_path: str
    num_gpus_per_engine: int = 1
    # `--sglang-X ...` tokens with the prefix stripped, in the order the user wrote them.
    forwarded_argv: tuple[str, ...] = ()
    # The same flags parsed by SGLang's own parser: dest -> value (only those the user set).
    server_args: dict = field(default_factory=dict)
    seed: int = 1234

    @property
    def module(self) -> str:
        return "sglang.launch_server" if self.backend == "sglang" else "slime_spec.engine"

    def server_argv(self, host: str, port: int, base_gpu_id: int = 0, python: str | None = None,
                    seed_offset: int = 0) -> list[str]:
        """The exact command line of one engine's server process (engine i: seed_offset=i, as slime)."""
        argv = [python or sys.executable, "-m", self.module,
                "--model-path", self.model_path,
                "--host", host, "--port", str(port),
                "--tp-size", str(self.num_gpus_per_engine),
                "--random-seed", str(self.seed + seed_offset)]
        if self.backend == "sglang":
            argv += ["--base-gpu-id", str(base_gpu_id)]
        return argv + list(self.forwarded_argv)

    @property
    def speculative_algorithm(self) -> str | None:
        return self.server_args.get("speculative_algorithm")


@dataclass(frozen=True)
class RolloutConfig:
    hf_checkpoint: str
    prompt_data: str | None = None
    input_key: str = "input"
    label_key: str | None = None
    apply_chat_template: bool = False
    rollout_shuffle: bool = False
    rollout_seed: int = 42
    rm_type: str | None = None
    custom_rm_path: str | None = None
    custom_generate_function_path: str | None = None
    num_rollout: int = 1
    rollout_batch_size: int = 8
    n_samples_per_prompt: int = 1
    rollout_max_response_len: int = 64
    rollout_max_prompt_len: int | None = None
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_stop: tuple[str, ...] = ()
    rollout_stop_token_ids: tuple[int, ...] = ()
    rollout_skip_special_tokens: bool = False
    eval_temperature: float | None = None  # each --eval-* flag falls back to its rollout flag
    eval_top_p: float | None = None
    eval_top_k: int | None = None
    eval_max_response_len: int | None = None
    n_samples_per_eval_prompt: int = 1
    max_concurrency: int = 64  # in-flight requests per engine (slime: --sglang-server-concurrency)
    use_sglang_router: bool = False
    save_debug_rollout_data: str | None = None
    load_debug_rollout_data: str | None = None
    metrics_jsonl: str | None = None
    engine_start_timeout_s: float = 300.0
    request_retries: int = 3


@dataclass(frozen=True)
class TrainConfig:
    hf_checkpoint: str
    load: str | None = None
    save: str | None = None
    ref_load: str | None = None
    save_interval: int | None = None
    loss_type: Literal["policy_loss", "sft"] = "policy_loss"
    advantage_estimator: str = "grpo"
    n_samples_per_prompt: int = 1
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    global_batch_size: int = 8
    micro_batch_size: int = 1
    mtp_num_layers: int = 0
    enable_mtp_training: bool = False
    mtp_loss_scaling_factor: float = 0.2
    tensor_model_parallel_size: int = 1
    seed: int = 1234


@dataclass(frozen=True)
class WeightSyncConfig:
    transport: Literal["distributed", "tensor", "disk"] = "distributed"
    update_weight_buffer_size: int = 512 * 1024**2
    check_weight_sync: bool = False


@dataclass(frozen=True)
class WandbConfig:
    use_wandb: bool = False
    wandb_project: str | None = None
    wandb_group: str | None = None
    wandb_key: str | None = None
    wandb_dir: str | None = None


@dataclass(frozen=True)
class Config:
    cluster: ClusterConfig
    engine: EngineConfig
    rollout: RolloutConfig
    train: TrainConfig
    weight_sync: WeightSyncConfig
    wandb: WandbConfig
    debug_rollout_only: bool = False
    debug_train_only: bool = False
    eval_interval: int | None = None
    eval_prompt_data: tuple[str, ...] = ()
    output_dir: str = "outputs"

    @property
    def num_engines(self) -> int:
        c = self.cluster
        if self.engine.backend == "sglang" and c.rollout_num_gpus:
            return max(1, c.rollout_num_gpus // c.rollout_num_gpus_per_engine)
        return c.rollout_num_engines
