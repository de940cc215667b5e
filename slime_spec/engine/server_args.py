"""The embedded server's flags: SGLang's own server flags, each one honoured, ignored or refused.

The flags are parsed with the installed SGLang's parser (`ServerArgs.add_cli_args`), so names,
aliases and defaults are SGLang's. Every flag whose value differs from SGLang's default is then
looked up in one data table:

- IMPLEMENTED: the embedded engine implements it;
- PERFORMANCE_ONLY: it tunes speed, memory or logging in SGLang and cannot change a generated
  token here; accepted and logged once at start;
- anything else: it would change results (quantization, LoRA, a token map, accept thresholds,
  parallelism, ...) or is simply not implemented, so the server refuses to start and names it.

`classify_flags` and the `resolve_*` helpers are pure; `parse_server_args` is the one entry point.
The speculative flags are resolved by `slime_spec.speculative.settings.resolve`, the same function doctor runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_spec.common.dtypes import canonical_dtype, config_dtype
from slime_spec.config.args import sglang_parser
from slime_spec.doctor.codes import SERVER_PREFIX, Rule, errors
from slime_spec.engine.kernels.ops import Kernels
from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings
from slime_spec.engine.speculative.policy import check_spec_options
from slime_spec.speculative import settings as spec

IMPLEMENTED = frozenset({
    "model_path", "tokenizer_path", "host", "port", "dtype", "device", "base_gpu_id", "context_length",
    "max_running_requests", "random_seed", "api_key", "admin_api_key", "served_model_name",
    "weight_version", "skip_tokenizer_init", "log_level", "trust_remote_code",
    "enable_deterministic_inference", "tp_size", "stream_interval",
    "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
    "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_ngram_max_trie_depth",
    "speculative_adaptive", "speculative_adaptive_config",
    "disable_cuda_graph", "cuda_graph_bs_decode", "cuda_graph_max_bs_decode", "disable_cuda_graph_padding",
    "enable_torch_compile", "torch_compile_max_bs", "disable_overlap_schedule", "enable_cudagraph_gc",
    "attention_backend", "decode_attention_backend", "bf16_gemm_backend", "gc_threshold", "enable_memory_saver",
    "sampling_backend",
})

# Speed, memory, scheduling, logging and serving knobs: they cannot change a generated token of the
# embedded engine (speculative decoding is lossless, so draft-shape knobs of NGRAM are speed only).
PERFORMANCE_ONLY = frozenset({
    "tokenizer_worker_num", "detokenizer_worker_num", "enable_tf32_matmul", "mem_fraction_static",
    "max_queued_requests", "max_total_tokens", "chunked_prefill_size", "prefill_decode_interval",
    "enable_dynamic_chunking", "max_prefill_tokens", "prefill_max_requests", "schedule_policy",
    "schedule_conservativeness", "page_size", "disable_radix_cache", "radix_eviction_policy",
    "disable_chunked_prefix_cache", "num_continuous_decode_steps",
    "scheduler_recv_interval", "enable_mixed_chunk", "nccl_port", "dist_timeout", "watchdog_timeout",
    "soft_watchdog_timeout", "sleep_on_idle", "skip_server_warmup", "warmups",
    "batch_notify_size", "gpu_id_step", "numa_node", "enable_p2p_check",
    "log_level_http", "log_requests", "log_requests_level", "log_requests_format", "log_requests_target",
    "uvicorn_access_log_exclude_prefixes", "crash_dump_folder", "show_time_cost", "enable_metrics",
    "enable_mfu_metrics", "enable_metrics_for_all_schedulers", "decode_log_interval",
    "enable_request_time_stats_logging", "enable_trace", "enable_cache_report", "gc_warning_threshold_secs",
    "export_metrics_to_file", "export_metrics_to_file_dir", "bucket_time_to_first_token",
    "bucket_inter_token_latency", "bucket_e2e_request_latency", "prompt_tokens_buckets",
    "generation_tokens_buckets", "load_snapshot_publish_interval",
    "prefill_attention_backend",
    "grammar_backend", "mm_attention_backend", "fp8_gemm_runner_backend", "fp4_gemm_runner_backend",
    "moe_runner_backend",
    "disable_prefill_cuda_graph", "disable_decode_cuda_graph", "enable_profile_cuda_graph",
    "debug_cuda_graph",
    "triton_attention_reduce_in_fp32", "triton_attention_num_kv_splits", "triton_attention_split_tile_size",
    "disable_custom_all_reduce", "enable_nccl_nvls", "enable_symm_mem",
    "enable_weights_cpu_backup", "enable_draft_weights_cpu_backup", "enable_hierarchical_cache",
    "startup_weight_load_mode", "weight_loader_disable_mmap", "weight_loader_prefetch_checkpoints",
    "weight_loader_prefetch_num_threads", "weight_loader_drop_cache_after_load",
    "speculative_attention_mode", "speculative_draft_attention_backend", "speculative_ngram_min_bfs_breadth",
    "speculative_ngram_max_bfs_breadth", "speculative_ngram_match_type", "speculative_ngram_capacity",
    "enable_custom_logit_processor", "enable_return_hidden_states",
})
# Read by SGLang's own front end (TokenizerManager, OpenAI-compatible serving), which the embedded engine runs.
FRONT_END = frozenset({"sampling_defaults", "chat_template", "completion_template", "reasoning_parser",
                       "tool_call_parser"})
PERFORMANCE_ONLY_PREFIXES = ("cuda_graph_", "hicache_", "enable_http2", "http2_")

# Refusals with a specific reason; every other non-default, non-table flag gets the generic one.
REFUSAL_REASONS = {
    "tp_size": "the embedded engine runs one process on one device: use --tp-size 1, or backend sglang "
               "for tensor parallelism",
    "quantization": "quantized weights change the logits; the embedded engine serves the checkpoint's "
                    "weights in --dtype only",
    "kv_cache_dtype": "a low-precision KV cache changes results; the embedded engine keeps it in --dtype",
    "speculative_token_map": "a reduced draft vocabulary (EAGLE3 token map) is not implemented",
    "speculative_accept_threshold_single": "relaxed acceptance is lossy; the embedded engine only verifies "
                                           "losslessly (threshold 1.0)",
    "speculative_accept_threshold_acc": "relaxed acceptance is lossy; the embedded engine only verifies "
                                        "losslessly (threshold 1.0)",
    "enable_lora": "LoRA adapters are not implemented",
    "lora_paths": "LoRA adapters are not implemented",
    "allow_auto_truncate": "silently truncating prompts changes results; the embedded engine rejects "
                           "over-long requests instead",
}

# Our own flags (not SGLang's; real SGLang would reject them): dest -> (flag, help).
OWN_FLAGS = {
    "spec_draft_sampling": ("--spec-draft-sampling",
                            "chain drafters (EAGLE/NEXTN MTP, STANDALONE) sample the drafts of sampled requests from "
                            "their own distribution q and verify with min(1, p/q) (lossless; SGLang drafts argmax)"),
    "spec_auto": ("--spec-auto",
                  "choose the draft length per step (0 = plain decoding) from measured draft and verify costs and "
                  "the accept rate, to maximise tokens/s"),
}


class ServerArgsError(ValueError):
    """A flag the embedded engine cannot honour; the message names every offending flag."""


@dataclass(frozen=True)
class FlagReport:
    ignored: tuple[str, ...]  # "--flag=value" accepted and ignored
    refused: tuple[str, ...]  # "--flag=value: reason"


def _health_check_timeout() -> float:
    raw = os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ServerArgsError(f"SGLANG_HEALTH_CHECK_TIMEOUT={raw!r}: expected a positive number of seconds "
                              "(SGLang's default is 20); unset it or fix the value")
    return value


@dataclass(frozen=True)
class EngineServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "float32"
    context_length: int | None = None
    max_running_requests: int = 32  # resolve_max_running_requests
    random_seed: int = 0
    api_key: str | None = None
    admin_api_key: str | None = None
    served_model_name: str = ""
    weight_version: str = "default"
    skip_tokenizer_init: bool = False
    log_level: str = "info"
    health_check_timeout_s: float = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT (env), read once here
    spec: spec.SpecConfig | None = None  # None: no speculative decoding
    spec_warnings: tuple[str, ...] = ()  # what spec.resolve changed or noted (no errors: those refuse)
    spec_draft_sampling: bool = False    # ours: --spec-draft-sampling
    spec_auto: bool = False              # ours: --spec-auto
    cuda_graph: CudaGraphSettings = field(default_factory=CudaGraphSettings)
    kernels: Kernels = field(default_factory=Kernels)  # --bf16-gemm-backend, --attention-backend (CUDA only)
    overlap_schedule: bool | None = None  # False with --disable-overlap-schedule; None: the engine's default
    gc_threshold: tuple[int, ...] | None = None  # --gc-threshold: set before the collector freezes after start-up
    memory_saver: bool = False  # --enable-memory-saver: release/resume keep addresses (model_executor/memory_saver.py)
    ignored_flags: tuple[str, ...] = ()
    sglang_args: dict = field(default_factory=dict)  # every SGLang flag's value, for /server_info

    @property
    def has_draft_model(self) -> bool:
        """A draft runner with weights (MTP layers or a STANDALONE model) serves weight updates too."""
        return self.spec is not None and self.spec.speculative_algorithm.uses_draft_model


def engine_parser() -> argparse.ArgumentParser:
    """The embedded engine's command line: SGLang's own server parser, with --help, plus OWN_FLAGS."""
    sglang = sglang_parser("python -m slime_spec.engine", "slime-spec's embedded SGLang-compatible server",
                           standalone=True)  # cached and shared: extended through a child parser, never mutated
    parser = argparse.ArgumentParser(prog=sglang.prog, description=sglang.description, parents=[sglang],
                                     add_help=False)
    group = parser.add_argument_group("slime-spec's own speculative options (embedded engine only)")
    for dest, (flag, help_text) in OWN_FLAGS.items():
        group.add_argument(flag, dest=dest, action="store_true", help=help_text)
    return parser


def option_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """dest -> the flag as a user types it (its first option string)."""
    return {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"}


def defaults_of(parser: argparse.ArgumentParser) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in parser._actions:
        if a.option_strings and a.dest != "help":
            out.setdefault(a.dest, a.default)
    return out


def is_performance_only(dest: str) -> bool:
    return dest in PERFORMANCE_ONLY or dest.startswith(PERFORMANCE_ONLY_PREFIXES)


def classify_flags(values: dict[str, Any], defaults: dict[str, Any], names: dict[str, str]) -> FlagReport:
    """Sort every flag whose value differs from SGLang's default into ignored or refused."""
    ignored, refused = [], []
    for dest, value in values.items():
        if dest not in defaults or value == defaults[dest] or dest in OWN_FLAGS:
            continue
        shown = f"{names.get(dest, '--' + dest.replace('_', '-'))}={value!r}"
        if dest == "tp_size" and value != 1:
            refused.append(f"{shown}: {REFUSAL_REASONS['tp_size']}")
        elif dest in IMPLEMENTED or dest in FRONT_END:
            continue
        elif is_performance_only(dest):
            ignored.append(shown)
        else:
            reason = REFUSAL_REASONS.get(dest, "not implemented by the embedded engine and may change results")
            refused.append(f"{shown}: {reason}")
    return FlagReport(tuple(ignored), tuple(refused))


def resolve_device(device: str | None, cuda_available: bool) -> str:
    if device is None:
        return "cuda" if cuda_available else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ServerArgsError(f"--device={device!r}: the embedded engine runs on 'cpu' or 'cuda'")
    if device.startswith("cuda") and not cuda_available:
        raise ServerArgsError(f"--device={device!r} but torch sees no CUDA device; use --device cpu")
    return device


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str | None) -> str:
    """SGLang's 'auto' rule (checkpoint dtype; float32 checkpoints served in float16) on CUDA.

    On CPU 'auto' means float32: half precision on CPU is slow and would make the CPU reference
    engine less exact than the models it checks.
    """
    if dtype != "auto":
        return canonical_dtype(dtype)
    if not device.startswith("cuda"):
        return "float32"
    served = canonical_dtype(checkpoint_dtype or "float32")
    return "float16" if served == "float32" else served


def _names_own_mtp_layers(algorithm: str | None, draft_path: str | None, model_path: str) -> bool:
    """EAGLE (or NEXTN) with the target checkpoint given as its draft path."""
    try:
        eagle = algorithm is not None and spec.Algorithm.parse(algorithm) is spec.Algorithm.EAGLE
    except ValueError:
        return False  # an unknown name: spec.resolve reports it
    return eagle and bool(draft_path) and Path(draft_path).resolve() == Path(model_path).resolve()


def read_model_config(model_path: str) -> dict:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ServerArgsError(f"--model-path={model_path!r}: no config.json there (an HF checkpoint directory "
                              f"with config.json, *.safetensors and a tokenizer is expected)")
    return json.loads(path.read_text())


def resolve_gc_threshold(value: list[int] | None) -> tuple[int, ...] | None:
    """`--gc-threshold`: 1 to 3 generation thresholds for gc.set_threshold, as SGLang's help says."""
    if value is None:
        return None
    if not 1 <= len(value) <= 3 or any(v < 0 for v in value):
        raise ServerArgsError(f"--gc-threshold={' '.join(map(str, value))}: give 1 to 3 non-negative integers "
                              "(gc.set_threshold's generation 0, 1 and 2 thresholds), or drop the flag")
    return tuple(value)


# --max-running-requests unset without speculation: SGLang sizes the limit from its paged KV pool (at least 2048
# requests where the pool holds them); the embedded engine's cache is static, a slot of the whole context per
# request, so it keeps a small default and the fleet passes the rollout's in-flight requests instead
# (EngineConfig.server_argv).
PLAIN_MAX_RUNNING_REQUESTS = 32


def resolve_max_running_requests(value: int | None, spec_config: spec.SpecConfig | None) -> tuple[int, tuple[str, ...]]:
    """(--max-running-requests or its default, what the start-up log says of it): SGLang 0.5.23 resets an unset limit
    to 48 when speculative decoding is on (`_handle_eagle_family`, `_handle_ngram`), with a warning;
    PLAIN_MAX_RUNNING_REQUESTS without speculation."""
    if value is not None:
        return value, ()
    if spec_config is None:
        return PLAIN_MAX_RUNNING_REQUESTS, ()
    return spec.SPEC_MAX_RUNNING_REQUESTS, (
        f"max running requests is reset to {spec.SPEC_MAX_RUNNING_REQUESTS} for speculative decoding, as SGLang does; "
        "set --max-running-requests to run more requests at once",)


def check_memory_saver(device: str) -> None:
    """--enable-memory-saver, checked before SGLang's launcher preloads torch_memory_saver's allocator hook into the
    scheduler process (or fails there on a bare ImportError)."""
    from slime_spec.engine.model_executor.memory_saver import unavailable_reason
    reason = unavailable_reason(device)
    if reason:
        raise ServerArgsError(reason)


def parse_server_args(argv: list[str], cuda_available: bool | None = None) -> EngineServerArgs:
    """Parse SGLang server flags into the embedded engine's typed arguments, or raise ServerArgsError."""
    parser = engine_parser()
    values = vars(parser.parse_args(argv))
    names = option_names(parser)
    report = classify_flags(values, defaults_of(parser), names)
    if values["tokenizer_path"] not in (None, values["model_path"]):
        report = FlagReport(report.ignored, report.refused + (
            f"--tokenizer-path={values['tokenizer_path']!r}: the embedded engine loads the tokenizer from "
            f"--model-path; drop the flag or point it at the same directory",))
    if report.refused:
        raise ServerArgsError(str(Rule.EMBEDDED_FLAG_REFUSED.finding(sg=SERVER_PREFIX,
                                                                      flags="\n  " + "\n  ".join(report.refused))))
    if not values["model_path"]:
        raise ServerArgsError("--model-path is required")
    config = read_model_config(values["model_path"])
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    device = resolve_device(values["device"], cuda_available)
    if device == "cuda" and values["base_gpu_id"]:
        device = f"cuda:{values['base_gpu_id']}"
    spec_args = values
    if _names_own_mtp_layers(values["speculative_algorithm"], values["speculative_draft_model_path"],
                             values["model_path"]):
        spec_args = {**values, "speculative_draft_model_path": None}  # the target's own MTP layers
    spec_config, findings = spec.resolve(spec_args, target_config=config, backend="embedded", sg=SERVER_PREFIX)
    if errors(findings):
        raise ServerArgsError("; ".join(map(str, errors(findings))))
    try:
        check_spec_options(spec_config, bool(values.get("spec_draft_sampling")), bool(values.get("spec_auto")))
    except ValueError as e:
        raise ServerArgsError(str(e)) from e
    if values.get("enable_memory_saver"):
        check_memory_saver(device)
    max_running, running_note = resolve_max_running_requests(values["max_running_requests"], spec_config)
    seed = values["random_seed"] if values["random_seed"] is not None else random.randint(0, 1 << 30)
    return EngineServerArgs(
        model_path=values["model_path"], host=values["host"], port=values["port"], device=device,
        dtype=resolve_dtype(values["dtype"], device, config_dtype(config)),
        context_length=values["context_length"],
        max_running_requests=max_running,
        random_seed=seed,
        api_key=values["api_key"], admin_api_key=values["admin_api_key"],
        served_model_name=values["served_model_name"] or values["model_path"],
        weight_version=values["weight_version"], skip_tokenizer_init=values["skip_tokenizer_init"],
        log_level=values["log_level"], health_check_timeout_s=_health_check_timeout(), spec=spec_config,
        spec_warnings=tuple(map(str, findings)) + running_note,
        spec_draft_sampling=bool(values.get("spec_draft_sampling")), spec_auto=bool(values.get("spec_auto")),
        cuda_graph=CudaGraphSettings.from_values(values),
        kernels=Kernels.from_values(values),
        overlap_schedule=False if values.get("disable_overlap_schedule") else None,
        gc_threshold=resolve_gc_threshold(values["gc_threshold"]),
        memory_saver=bool(values.get("enable_memory_saver")),
        ignored_flags=report.ignored,
        sglang_args={k: v for k, v in values.items() if k not in ("api_key", "admin_api_key")},
    )


def sglang_argv(argv: list[str], args: EngineServerArgs) -> list[str]:
    """The argv SGLang's own ServerArgs parses: ours (OWN_FLAGS) removed, and the device named (SGLang refuses to
    start without an accelerator unless told `--device cpu`)."""
    own = {flag for flag, _ in OWN_FLAGS.values()}
    out = [a for a in argv if a not in own]
    if not any(a == "--device" or a.startswith("--device=") for a in out):
        out += ["--device", args.device.split(":")[0]]
    # the dtype the engine serves ('auto' resolved: float32 on CPU), so /server_info reports what is hashed
    out = [a for i, a in enumerate(out) if not (a == "--dtype" or a.startswith("--dtype=") or
                                                (i and out[i - 1] == "--dtype"))]
    return out + ["--dtype", args.dtype]
