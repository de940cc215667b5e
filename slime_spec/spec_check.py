"""Speculative-decoding checks: each known failure mode as a code, a message and a fix.

Pure functions over plain data (the parsed SGLang flags, the target's and draft's config.json,
a few slime flags), so every check is tested without processes, torch or a GPU. The rules
mirror what SGLang 0.5.23 itself does (sglang/srt/arg_groups/speculative_hook.py and
model_override_base.py) and the failures users hit (see docs/en/speculative.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

EAGLE_FAMILY = {"EAGLE", "EAGLE3", "NEXTN", "STANDALONE"}
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
SUGGESTED_CUDA_GRAPH_BS = [*range(1, 33), *range(40, 65, 8), *range(80, 161, 16)]
# SGLang resets max_running_requests to 48 for speculative decoding when it is unset.
SGLANG_SPEC_DEFAULT_MAX_RUNNING = 48
# The embedded engine honours these algorithms with a chain draft (top-k 1).
EMBEDDED_ALGORITHMS = {"EAGLE", "NEXTN", "STANDALONE", "NGRAM"}


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning" | "info"
    code: str
    message: str
    fix: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CheckInput:
    sglang: dict  # SGLang dest -> value, only the flags the user set
    backend: str  # "sglang" | "embedded"
    sglang_version: str
    target_config: dict | None
    draft_config: dict | None = None
    enable_mtp_training: bool = False
    mtp_num_layers: int = 0
    longest_prompt_tokens: int | None = None
    max_response_len: int | None = None
    model_flags: dict = field(default_factory=dict)  # Megatron model-shape flags the user set
    debug_rollout_only: bool = False  # no trainer: the model only has to be served
    colocate: bool = False


def _version_tuple(v: str) -> tuple[int, ...]:
    from slime_spec.weight_sync.protocol import parse_version  # pure, torch-free

    return parse_version(v) or (0,)


def config_dtype(cfg: dict) -> str | None:
    d = cfg.get("torch_dtype") or cfg.get("dtype")
    return str(d).replace("torch.", "") if d else None


def native_mtp_layers(cfg: dict | None) -> int:
    if not cfg:
        return 0
    return max(int(cfg.get(k) or 0) for k in MTP_CONFIG_KEYS)


def algorithm(inp: CheckInput) -> str | None:
    algo = inp.sglang.get("speculative_algorithm")
    return algo.upper() if isinstance(algo, str) else None


def check_dtype(inp: CheckInput) -> list[Finding]:
    if inp.draft_config is None or inp.target_config is None or inp.sglang.get("dtype") not in (None, "auto"):
        return []
    td, dd = config_dtype(inp.target_config), config_dtype(inp.draft_config)
    if td and dd and td != dd:
        return [Finding("error", "SPEC_DTYPE_MISMATCH",
                        f"the draft model is {dd} but the target is {td}, and --sglang-dtype is unset: SGLang then "
                        f"fails with 'Capture cuda graph failed'",
                        f"--sglang-dtype {dd}")]
    return []


def _max_pos(cfg: dict | None) -> int | None:
    if not cfg:
        return None
    v = cfg.get("max_position_embeddings") or cfg.get("max_sequence_length")
    return int(v) if v else None


def check_context_length(inp: CheckInput) -> list[Finding]:
    out = []
    ctx = inp.sglang.get("context_length")
    t_len, d_len = _max_pos(inp.target_config), _max_pos(inp.draft_config)
    if d_len and t_len and d_len < t_len and (ctx is None or ctx > d_len):
        out.append(Finding(
            "error", "SPEC_CONTEXT_LENGTH",
            f"the draft supports {d_len} positions, the target {t_len}, and --sglang-context-length is "
            f"{'unset' if ctx is None else ctx}: SGLang requires draft and target context lengths to agree, and a "
            f"mismatch can cause an illegal memory access (SGLang PR #9388)",
            f"--sglang-context-length {d_len}"))
    effective = ctx or (min(x for x in (t_len, d_len) if x) if (t_len or d_len) else None)
    if effective and inp.longest_prompt_tokens is not None and inp.max_response_len is not None:
        need = inp.longest_prompt_tokens + inp.max_response_len
        if need > effective:
            out.append(Finding(
                "error", "SPEC_CONTEXT_LENGTH",
                f"the longest prompt ({inp.longest_prompt_tokens} tokens) plus --rollout-max-response-len "
                f"({inp.max_response_len}) needs {need} positions but the context length is {effective}",
                f"lower --rollout-max-response-len to {max(1, effective - inp.longest_prompt_tokens)}, set "
                f"--rollout-max-prompt-len to filter long prompts, or use a model with a longer context"))
    return out


def check_flashinfer(inp: CheckInput) -> list[Finding]:
    algo = algorithm(inp)
    if algo not in EAGLE_FAMILY:
        return []
    backend = inp.sglang.get("attention_backend")
    topk = inp.sglang.get("speculative_eagle_topk") or 1
    if backend == "flashinfer":
        why = "--sglang-attention-backend flashinfer is set"
    elif backend is None:
        why = ("no --sglang-attention-backend is set, and SGLang then picks flashinfer "
               + ("(with --sglang-speculative-eagle-topk > 1 even on Hopper)" if topk > 1 else "on GPUs other than Hopper"))
    else:
        return []
    return [Finding("warning", "SPEC_FLASHINFER",
                    f"{why}: {algo} with flashinfer is exposed to CUDA-graph padding failures in the draft stage "
                    f"(SGLang #9888, #9521)",
                    "--sglang-attention-backend fa3 (Hopper) or --sglang-attention-backend triton")]


def check_cuda_graph_bs(inp: CheckInput) -> list[Finding]:
    sg = inp.sglang
    graphs_off = (sg.get("disable_cuda_graph") or sg.get("disable_decode_cuda_graph")
                  or sg.get("cuda_graph_backend_decode") == "disabled")
    if algorithm(inp) is None or graphs_off:
        return []
    max_running = sg.get("max_running_requests") or SGLANG_SPEC_DEFAULT_MAX_RUNNING
    # `cuda_graph_bs_decode` since SGLang 0.5.2x; `cuda_graph_bs` before.
    bs = sorted(set(sg.get("cuda_graph_bs_decode") or sg.get("cuda_graph_bs") or []))
    dense_upto = min(32, max_running)
    problems = []
    if not bs:
        problems.append("--sglang-cuda-graph-bs-decode is unset, so SGLang captures a sparse default list and pads "
                        "most batch sizes")
    else:
        missing = [b for b in range(1, dense_upto + 1) if b not in bs]
        if missing:
            problems.append(f"batch sizes {missing[:8]}{'...' if len(missing) > 8 else ''} are not captured and get padded")
        if bs[-1] < max_running:
            problems.append(f"the largest captured batch ({bs[-1]}) is below the max running requests ({max_running})")
    if not problems:
        return []
    suggestion = "$(seq 1 32) $(seq 40 8 64) $(seq 80 16 160)"
    return [Finding("warning", "SPEC_CUDA_GRAPH_BS",
                    "; ".join(problems) + ". CUDA-graph padding in the draft stage is a known failure with "
                    "speculative decoding; --sglang-disable-cuda-graph-padding does not help with speculation",
                    f"--sglang-cuda-graph-bs-decode {suggestion} (covering up to --sglang-max-running-requests)")]


def check_topk_tokens(inp: CheckInput) -> list[Finding]:
    algo = algorithm(inp)
    if algo is None or algo == "NGRAM":
        return []
    steps = inp.sglang.get("speculative_num_steps")
    topk = inp.sglang.get("speculative_eagle_topk")
    tokens = inp.sglang.get("speculative_num_draft_tokens")
    if steps is None:
        if topk is not None or tokens is not None:
            return [Finding("error", "SPEC_TOPK_TOKENS",
                            "--sglang-speculative-eagle-topk / -num-draft-tokens are set without "
                            "--sglang-speculative-num-steps; SGLang then asserts at start (it only auto-chooses all "
                            "three together)",
                            "set --sglang-speculative-num-steps too (e.g. 3 with top-k 1 and 4 draft tokens)")]
        return []
    topk = 1 if topk is None else topk
    out = []
    if steps < 1 or topk < 1 or (tokens is not None and tokens < 1):
        out.append(Finding("error", "SPEC_TOPK_TOKENS", "num-steps, eagle-topk and num-draft-tokens must be >= 1",
                           "e.g. --sglang-speculative-num-steps 3 --sglang-speculative-eagle-topk 1 "
                           "--sglang-speculative-num-draft-tokens 4"))
        return out
    if topk == 1 and tokens is not None and tokens != steps + 1:
        out.append(Finding("warning", "SPEC_TOPK_TOKENS",
                           f"with --sglang-speculative-eagle-topk 1 a chain of {steps} steps verifies {steps + 1} "
                           f"tokens; SGLang silently overrides --sglang-speculative-num-draft-tokens {tokens} to "
                           f"{steps + 1}",
                           f"--sglang-speculative-num-draft-tokens {steps + 1}"))
    if topk > 1 and tokens is not None:
        capacity = topk + (steps - 1) * topk * topk + 1
        if tokens > capacity:
            out.append(Finding("error", "SPEC_TOPK_TOKENS",
                               f"a tree of {steps} steps with top-k {topk} has at most {capacity} nodes (root "
                               f"included); --sglang-speculative-num-draft-tokens {tokens} cannot be filled",
                               f"--sglang-speculative-num-draft-tokens {capacity} or fewer"))
        if tokens <= steps:
            out.append(Finding("warning", "SPEC_TOPK_TOKENS",
                               f"{tokens} draft tokens cannot hold one path of {steps} steps: most drafted steps are "
                               f"wasted", f"--sglang-speculative-num-draft-tokens {steps + 1} or more"))
        page = inp.sglang.get("page_size") or 1
        backend = inp.sglang.get("attention_backend")
        if page > 1 and backend not in (None, "flashinfer", "fa3", "triton"):
            out.append(Finding("error", "SPEC_TOPK_TOKENS",
                               f"top-k > 1 with --sglang-page-size {page} is only supported by the flashinfer, fa3 "
                               f"and triton attention backends (SGLang refuses {backend})",
                               "--sglang-page-size 1 or --sglang-attention-backend fa3"))
    return out


def check_no_mtp(inp: CheckInput) -> list[Finding]:
    if algorithm(inp) not in ("EAGLE", "NEXTN") or inp.sglang.get("speculative_draft_model_path"):
        return []
    if inp.target_config is not None and native_mtp_layers(inp.target_config) == 0:
        return [Finding("error", "SPEC_NO_MTP",
                        f"{algorithm(inp)} without --sglang-speculative-draft-model-path needs native MTP layers, but "
                        f"the target's config.json has none (no {' / '.join(MTP_CONFIG_KEYS)})",
                        "--sglang-speculative-draft-model-path <an EAGLE draft>, or --sglang-speculative-algorithm NGRAM")]
    return []


def check_eagle3_draft(inp: CheckInput) -> list[Finding]:
    if algorithm(inp) == "EAGLE3" and not inp.sglang.get("speculative_draft_model_path"):
        return [Finding("error", "SPEC_EAGLE3_NO_DRAFT", "EAGLE3 needs an external draft model",
                        "--sglang-speculative-draft-model-path <EAGLE3 draft dir>")]
    if algorithm(inp) == "STANDALONE" and not inp.sglang.get("speculative_draft_model_path"):
        return [Finding("error", "SPEC_EAGLE3_NO_DRAFT", "STANDALONE needs a draft model",
                        "--sglang-speculative-draft-model-path <small draft model dir>")]
    return []


def check_sglang_version(inp: CheckInput) -> list[Finding]:
    if inp.backend != "sglang" or not inp.sglang.get("speculative_draft_model_path"):
        return []
    if _version_tuple(inp.sglang_version) < (0, 5, 1):
        return [Finding("error", "SPEC_SGLANG_VERSION",
                        f"an external draft model with SGLang {inp.sglang_version}: releases before 0.5.1 hit an "
                        f"illegal memory access when draft and target context lengths differ (PR #9388)",
                        "upgrade SGLang to 0.5.1 or newer")]
    return []


def check_mtp_training(inp: CheckInput) -> list[Finding]:
    if not inp.enable_mtp_training:
        return []
    if inp.mtp_num_layers < 1:
        return [Finding("error", "SPEC_MTP_TRAINING", "--enable-mtp-training without --mtp-num-layers >= 1",
                        "--mtp-num-layers 1 (the number of MTP layers in the checkpoint)")]
    native = native_mtp_layers(inp.target_config)
    if inp.target_config is not None and native == 0:
        return [Finding("error", "SPEC_MTP_TRAINING",
                        "--enable-mtp-training on a model whose config.json has no MTP layers",
                        "use a model with native MTP layers (MiMo, DeepSeek-V3, GLM-4.5) or drop --enable-mtp-training")]
    if inp.target_config is not None and inp.mtp_num_layers > native:
        return [Finding("error", "SPEC_MTP_TRAINING",
                        f"--mtp-num-layers {inp.mtp_num_layers} but the checkpoint has {native} MTP layer(s)",
                        f"--mtp-num-layers {native}")]
    return []


def check_backend_support(inp: CheckInput) -> list[Finding]:
    algo = algorithm(inp)
    if inp.backend != "embedded" or algo is None:
        return []
    out = []
    if algo not in EMBEDDED_ALGORITHMS:
        out.append(Finding("error", "SPEC_UNSUPPORTED_BY_BACKEND",
                           f"the embedded engine does not implement {algo}",
                           "on a GPU node use --rollout-backend sglang; on CPU use NEXTN/EAGLE (native MTP), "
                           "STANDALONE or NGRAM"))
    if algo != "NGRAM" and (inp.sglang.get("speculative_eagle_topk") or 1) > 1:
        out.append(Finding("error", "SPEC_UNSUPPORTED_BY_BACKEND",
                           "the embedded engine drafts chains only (tree drafts with top-k > 1 are not implemented)",
                           "--sglang-speculative-eagle-topk 1, or --rollout-backend sglang on a GPU node"))
    return out


def check_model_flags(inp: CheckInput, shape_flags: dict) -> list[Finding]:
    """Megatron MODEL_ARGS vs the HF config.json: a mismatch is an error naming both values."""
    if inp.target_config is None:
        return []
    out = []
    cfg = inp.target_config
    for dest, value in inp.model_flags.items():
        if dest not in shape_flags:
            continue
        keys, kind = shape_flags[dest]
        key = next((k for k in keys if k in cfg), None)
        if kind == "untied":
            hf_val, ours = not bool(cfg.get("tie_word_embeddings", False)), bool(value)
            if hf_val == ours:
                continue
            msg = f"--untie-embeddings-and-output-weights is {'set' if ours else 'unset'} but config.json has tie_word_embeddings={not hf_val}"
        elif kind == "qkv_bias":
            hf_bias = bool(cfg.get("attention_bias", cfg.get("model_type") in ("qwen2", "mimo")))
            if hf_bias == bool(value):
                continue
            msg = f"--add-qkv-bias is {'set' if value else 'unset'} but the HF model has qkv bias={hf_bias}"
        else:
            if key is None:
                continue
            hf_val = cfg[key]
            if (kind == "int" and int(hf_val) == int(value)) or (kind == "float" and abs(float(hf_val) - float(value)) <= 1e-9 * max(1.0, abs(float(hf_val)))):
                continue
            msg = f"--{dest.replace('_', '-')} {value} but config.json has {key}={hf_val}"
        out.append(Finding("error", "MODEL_ARGS_MISMATCH", msg,
                           "make MODEL_ARGS match the checkpoint (scripts/models/*.sh) or point --hf-checkpoint at the right model"))
    return out


TRAINER_FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mimo": "MiMoForCausalLM"}


def check_trainer_support(inp: CheckInput) -> list[Finding]:
    """The trainer builds Llama, Qwen2 and MiMo with plain RoPE and SwiGLU (slime_spec/trainer/model.py)."""
    cfg = inp.target_config
    if inp.debug_rollout_only or cfg is None:
        return []
    archs = cfg.get("architectures") or []
    family = cfg.get("model_type") if cfg.get("model_type") in TRAINER_FAMILIES else \
        next((f for f, a in TRAINER_FAMILIES.items() if a in archs), None)
    fix = "run rollouts alone with --debug-rollout-only, or train a Llama / Qwen2 / MiMo model"
    if family is None:
        return [Finding("error", "TRAINER_UNSUPPORTED_MODEL",
                        f"the trainer builds Llama, Qwen2 and MiMo models; this checkpoint is "
                        f"{cfg.get('model_type') or archs} (its weights convert, but it cannot be trained yet)", fix)]
    scaling = cfg.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        return [Finding("error", "TRAINER_UNSUPPORTED_MODEL",
                        f"rope_scaling type {rope_type!r}: the trainer implements plain RoPE only", fix)]
    if cfg.get("hidden_act", "silu") != "silu":
        return [Finding("error", "TRAINER_UNSUPPORTED_MODEL",
                        f"hidden_act={cfg['hidden_act']!r}: the trainer builds SwiGLU (silu) MLPs only", fix)]
    return []


def check_colocate(inp: CheckInput) -> list[Finding]:
    """Colocated SGLang releases engine memory around training; both switches below are needed for that."""
    if not inp.colocate or inp.debug_rollout_only:
        return []
    out = []
    if not inp.sglang.get("enable_memory_saver"):
        out.append(Finding("warning", "COLOCATE_MEMORY_SAVER",
                           "--colocate without --sglang-enable-memory-saver: SGLang's release_memory_occupation then "
                           "frees nothing, and the trainer and the engines compete for GPU memory",
                           "--sglang-enable-memory-saver"))
    if algorithm(inp) is not None and algorithm(inp) != "NGRAM" and not inp.sglang.get("enable_draft_weights_cpu_backup"):
        out.append(Finding("warning", "COLOCATE_DRAFT_BACKUP",
                           "--colocate with a draft model and no --sglang-enable-draft-weights-cpu-backup: the draft's "
                           "weights may not survive a release/resume cycle and acceptance silently collapses to ~1.0 "
                           "(slime forces this switch; watch spec_canary_accept_length after resume too)",
                           "--sglang-enable-draft-weights-cpu-backup"))
    return out


def run_checks(inp: CheckInput, shape_flags: dict | None = None) -> list[Finding]:
    findings: list[Finding] = []
    for check in (check_dtype, check_context_length, check_topk_tokens, check_no_mtp, check_eagle3_draft,
                  check_sglang_version, check_mtp_training, check_backend_support, check_trainer_support):
        findings += check(inp)
    if inp.backend == "sglang":
        findings += check_flashinfer(inp) + check_cuda_graph_bs(inp) + check_colocate(inp)
    elif algorithm(inp) is not None:
        findings.append(Finding("info", "SGLANG_ONLY_CHECKS_SKIPPED",
                                "backend embedded: the GPU-only checks SPEC_FLASHINFER and SPEC_CUDA_GRAPH_BS did not run",
                                "pass --rollout-backend sglang to check the configuration as on a GPU node"))
    if shape_flags:
        findings += check_model_flags(inp, shape_flags)
    return findings
