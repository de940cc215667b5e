"""Speculative-decoding checks: each known failure mode as a code, a message and a fix.

Pure functions over plain data (the parsed SGLang flags, the target's and draft's config.json,
a few slime flags), so every check is tested without processes, torch or a GPU. The speculative
settings themselves are resolved by `slime_spec.speculative.settings.resolve` (SGLang 0.5.23's rules, applied once);
the checks here add what needs the checkpoints, the GPU stack or the trainer. Codes, messages and
fixes come from `slime_spec.doctor.codes.Rule` (see docs/en/speculative.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from slime_spec.common.dtypes import config_dtype
from slime_spec.common.model_families import ARCHITECTURES, MLA_FAMILIES, MOE_FAMILIES
from slime_spec.config.run_config import moe_expert_layout_refusal
from slime_spec.doctor.codes import Finding, Rule
from slime_spec.engine.managers.finish import request_limits
from slime_spec.speculative import settings as spec
from slime_spec.speculative.settings import Algorithm, SpecConfig, native_mtp_layers

__all__ = ["CheckInput", "Finding", "run_checks"]


@dataclass
class CheckInput:
    sglang: dict  # SGLang dest -> value, only the flags the user set
    backend: str  # "sglang" | "embedded"
    sglang_version: str
    target_config: dict | None
    draft_config: dict | None = None
    enable_mtp_training: bool = False
    enable_draft_training: bool = False  # online EAGLE3 draft (trainer/eagle3_online.py)
    mtp_num_layers: int = 0
    mtp_unroll_steps: int = 1
    longest_prompt_tokens: int | None = None
    max_response_len: int | None = None
    model_flags: dict = field(default_factory=dict)  # Megatron model-shape flags the user set
    debug_rollout_only: bool = False  # no trainer: the model only has to be served
    colocate: bool = False
    history_drafting: bool = False  # --rollout-history-drafting and its bounds
    history_epochs: int = 1
    history_max_tokens: int = 8192
    prompts_per_rollout: int = 1    # --rollout-batch-size
    spec_draft_sampling: bool = False  # ours (--spec-draft-sampling): embedded engine only
    spec_auto: bool = False            # ours (--spec-auto): embedded engine only
    weight_sync_transport: str | None = None  # --weight-sync-transport (None: by --colocate)
    tensor_model_parallel_size: int = 1  # the trainer's (Megatron's --tensor-model-parallel-size)
    expert_model_parallel_size: int = 1  # the trainer's (Megatron's --expert-model-parallel-size)
    expert_tensor_parallel_size: int | None = None  # Megatron's --expert-tensor-parallel-size (None: the TP size)
    pipeline_model_parallel_size: int = 1  # the trainer's pipeline stages, and the first / last stage's layers
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    in_flight_per_engine: int | None = None  # the most requests the rollout keeps in flight on one engine

    @cached_property
    def resolved(self) -> tuple[SpecConfig | None, list[Finding]]:
        """The speculative settings as SGLang resolves them, and what resolving found."""
        return spec.resolve(self.sglang, target_config=self.target_config, backend=self.backend)

    @cached_property
    def algorithm(self) -> Algorithm | None:
        """None without speculation or for a name SGLang does not know (resolve reports that)."""
        name = self.sglang.get("speculative_algorithm")
        try:
            return Algorithm.parse(name) if name else None
        except ValueError:
            return None


def _version_tuple(v: str) -> tuple[int, ...]:
    from slime_spec.weight_sync.protocol import parse_version  # pure, torch-free

    return parse_version(v) or (0,)




def check_speculative(inp: CheckInput) -> list[Finding]:
    """Everything `spec.resolve` finds: shape knobs, drafts, adaptive, what the backend implements."""
    return inp.resolved[1]


def check_dtype(inp: CheckInput) -> list[Finding]:
    if inp.draft_config is None or inp.target_config is None or inp.sglang.get("dtype") not in (None, "auto"):
        return []
    td, dd = config_dtype(inp.target_config), config_dtype(inp.draft_config)
    if td and dd and td != dd:
        return [Rule.SPEC_DTYPE_MISMATCH.finding(draft=dd, target=td)]
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
        out.append(Rule.SPEC_CONTEXT_DRAFT_SHORTER.finding(draft=d_len, target=t_len,
                                                           ctx="unset" if ctx is None else ctx))
    effective = ctx or (min(x for x in (t_len, d_len) if x) if (t_len or d_len) else None)
    if effective and inp.longest_prompt_tokens is not None and inp.max_response_len is not None:
        prompt, response = inp.longest_prompt_tokens, inp.max_response_len
        # SGLang's scheduler refuses a prompt of max_req_input_len tokens or more, whatever the response length
        _, max_input = request_limits(effective)
        need = prompt + response
        if need > effective or prompt >= max_input:
            # such a prompt leaves nothing a shorter response could fit in: leave it out
            rule = (Rule.SPEC_CONTEXT_RESPONSE_TOO_LONG if response >= effective
                    else Rule.SPEC_CONTEXT_PROMPT_EXCEEDS if prompt >= max_input
                    else Rule.SPEC_CONTEXT_PROMPT_TOO_LONG)
            out.append(rule.finding(prompt=prompt, response=response, need=need, ctx=effective,
                                    max_input=max_input, fit=effective - prompt,
                                    limit=max(1, min(effective - response, max_input - 1))))
    return out


def check_flashinfer(inp: CheckInput) -> list[Finding]:
    algo = inp.algorithm
    if algo is None or not algo.eagle_family:
        return []
    config = inp.resolved[0]
    topk = (config.speculative_eagle_topk if config else inp.sglang.get("speculative_eagle_topk")) or 1
    backend = inp.sglang.get("attention_backend")
    if backend == "flashinfer":
        why = "--sglang-attention-backend flashinfer is set"
    elif backend is None:
        where = "(with --sglang-speculative-eagle-topk > 1 even on Hopper)" if topk > 1 else "on GPUs other than Hopper"
        why = "no --sglang-attention-backend is set, and SGLang then picks flashinfer " + where
    else:
        return []
    return [Rule.SPEC_FLASHINFER.finding(why=why, algorithm=algo)]


def check_cuda_graph_bs(inp: CheckInput) -> list[Finding]:
    sg = inp.sglang
    graphs_off = (sg.get("disable_cuda_graph") or sg.get("disable_decode_cuda_graph")
                  or sg.get("cuda_graph_backend_decode") == "disabled")
    if not sg.get("speculative_algorithm") or graphs_off:
        return []
    max_running = sg.get("max_running_requests") or spec.SPEC_MAX_RUNNING_REQUESTS
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
            shown = f"{missing[:8]}{'...' if len(missing) > 8 else ''}"
            problems.append(f"batch sizes {shown} are not captured and get padded")
        if bs[-1] < max_running:
            problems.append(f"the largest captured batch ({bs[-1]}) is below the max running requests ({max_running})")
    if not problems:
        return []
    return [Rule.SPEC_CUDA_GRAPH_BS.finding(problems="; ".join(problems))]


def check_sglang_version(inp: CheckInput) -> list[Finding]:
    if inp.backend != "sglang" or not inp.sglang.get("speculative_draft_model_path"):
        return []
    if _version_tuple(inp.sglang_version) < (0, 5, 1):
        return [Rule.SPEC_SGLANG_VERSION.finding(version=inp.sglang_version)]
    return []


def check_mtp_training(inp: CheckInput) -> list[Finding]:
    if not inp.enable_mtp_training:
        return []
    if inp.mtp_num_layers < 1:
        return [Rule.SPEC_MTP_TRAINING_NO_LAYERS.finding()]
    native = native_mtp_layers(inp.target_config)
    if inp.target_config is not None and native == 0:
        return [Rule.SPEC_MTP_TRAINING_NO_MTP.finding()]
    if inp.target_config is not None and inp.mtp_num_layers > native:
        return [Rule.SPEC_MTP_TRAINING_TOO_MANY.finding(layers=inp.mtp_num_layers, native=native)]
    config = inp.resolved[0]
    trained_steps = inp.mtp_num_layers + inp.mtp_unroll_steps - 1  # the last layer repeats past the others
    if config is not None and config.speculative_algorithm is Algorithm.EAGLE \
            and config.speculative_draft_model_path is None and (config.speculative_num_steps or 0) > trained_steps:
        return [Rule.SPEC_MTP_UNROLL_RECOMMENDED.finding(steps=config.speculative_num_steps,
                                                          layers=inp.mtp_num_layers, unroll=inp.mtp_unroll_steps,
                                                          need=config.speculative_num_steps - inp.mtp_num_layers + 1)]
    return []


EAGLE3_DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"


def eagle3_aux_layer_ids(draft_config: dict | None, num_target_layers: int) -> list[int]:
    """The target layers an EAGLE3 draft reads: its eagle_config ids, else SGLang's default (outputs of
    layers 1, L//2 - 1, L - 4); the same rule as common/eagle3_draft.py, without torch."""
    explicit = ((draft_config or {}).get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(explicit) if explicit else [1, num_target_layers // 2 - 1, num_target_layers - 4]


def check_draft_training(inp: CheckInput) -> list[Finding]:
    """--enable-draft-training: an EAGLE3 algorithm, an EAGLE3 draft, and aux layers the target has."""
    if not inp.enable_draft_training or inp.debug_rollout_only:
        return []
    if inp.algorithm is not Algorithm.EAGLE3:
        return [Rule.SPEC_DRAFT_TRAINING_NOT_EAGLE3.finding(algorithm=inp.sglang.get("speculative_algorithm"))]
    if inp.draft_config is not None:
        archs = inp.draft_config.get("architectures") or []
        if EAGLE3_DRAFT_ARCHITECTURE not in archs:
            return [Rule.SPEC_DRAFT_TRAINING_NOT_EAGLE3_DRAFT.finding(archs=archs)]
    if inp.target_config is not None and inp.target_config.get("num_hidden_layers"):
        layers = int(inp.target_config["num_hidden_layers"])
        ids = eagle3_aux_layer_ids(inp.draft_config, layers)
        if len(set(ids)) != len(ids) or any(not 0 <= i <= layers - 2 for i in ids):
            return [Rule.SPEC_DRAFT_TRAINING_AUX_LAYERS.finding(ids=ids, last=layers - 2, layers=layers)]
    return []


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
            msg = (f"--untie-embeddings-and-output-weights is {'set' if ours else 'unset'} but config.json has "
                   f"tie_word_embeddings={not hf_val}")
        elif kind == "qkv_bias":
            if inp.model_flags.get("multi_latent_attention"):
                continue  # Megatron builds MLA's projections without bias: --add-qkv-bias changes nothing there
            hf_bias = bool(cfg.get("attention_bias", cfg.get("model_type") in ("qwen2", "mimo")))
            if hf_bias == bool(value):
                continue
            msg = f"--add-qkv-bias is {'set' if value else 'unset'} but the HF model has qkv bias={hf_bias}"
        else:
            if key is None:
                continue
            hf_val = cfg[key]
            if kind == "int" and int(hf_val) == int(value):
                continue
            if kind == "float" and abs(float(hf_val) - float(value)) <= 1e-9 * max(1.0, abs(float(hf_val))):
                continue
            msg = f"--{dest.replace('_', '-')} {value} but config.json has {key}={hf_val}"
        out.append(Rule.MODEL_ARGS_MISMATCH.finding(detail=msg))
    return out




# megatron-core's MLA applies YaRN itself
TRAINER_ROPE_TYPES = {family: ("default", "yarn") for family in MLA_FAMILIES}


def check_trainer_support(inp: CheckInput) -> list[Finding]:
    """The trainer builds Llama, Qwen2, Qwen3, Qwen3-MoE, MiMo and GLM-4.5 with plain or llama3-scaled RoPE, and
    DeepSeek-V3 and GLM-4.7-Flash with plain or YaRN RoPE, all with SwiGLU (trainer/model.py)."""
    cfg = inp.target_config
    if inp.debug_rollout_only or cfg is None:
        return []
    archs = cfg.get("architectures") or []
    # every family the trainer builds, by model_type or architecture
    family = cfg.get("model_type") if cfg.get("model_type") in ARCHITECTURES else \
        next((f for f, a in ARCHITECTURES.items() if a in archs), None)
    if family is None:
        return [Rule.TRAINER_UNSUPPORTED_FAMILY.finding(family=cfg.get("model_type") or archs)]
    ep = inp.expert_model_parallel_size
    if family in MOE_FAMILIES and (why := moe_expert_layout_refusal(inp.tensor_model_parallel_size, ep,
                                                                     inp.expert_tensor_parallel_size)):
        return [Rule.TRAINER_MOE_TP_EP.finding(family=family, why=why)]
    if ep > 1 and family not in MOE_FAMILIES:
        return [Rule.TRAINER_EXPERT_PARALLEL.finding(ep=ep, family=family, why="it has no experts to split",
                                                     fix="--expert-model-parallel-size 1")]
    experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    if ep > 1 and experts % ep:
        return [Rule.TRAINER_EXPERT_PARALLEL.finding(
            ep=ep, family=family, why=f"each expert-parallel rank holds an equal share of the {experts} routed "
            f"experts (config.json num_experts / n_routed_experts), so the size must divide {experts}",
            fix=f"--expert-model-parallel-size dividing {experts}")]
    from slime_spec.trainer.pipeline import stage_layer_counts
    try:
        if cfg.get("num_hidden_layers"):
            stage_layer_counts(int(cfg["num_hidden_layers"]), inp.pipeline_model_parallel_size,
                               inp.decoder_first_pipeline_num_layers, inp.decoder_last_pipeline_num_layers)
    except ValueError as e:
        return [Rule.TRAINER_PIPELINE_LAYERS.finding(family=family, why=str(e))]
    scaling = cfg.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in TRAINER_ROPE_TYPES.get(family, ("default", "llama3")):
        return [Rule.TRAINER_UNSUPPORTED_ROPE.finding(rope_type=rope_type, family=family)]
    if cfg.get("hidden_act", "silu") != "silu":
        return [Rule.TRAINER_UNSUPPORTED_ACT.finding(act=cfg["hidden_act"])]
    return []


def check_quantized_checkpoint(inp: CheckInput) -> list[Finding]:
    """A quantized checkpoint trains only in the one format the sync reproduces, the target's block-wise FP8 as
    DeepSeek-V3 ships (weight_sync/fp8.py: quantized on the way, with its scales); a separate draft is synced
    unquantized."""
    from slime_spec.weight_sync import fp8
    if inp.debug_rollout_only:
        return []
    out = []
    for which, cfg in (("--hf-checkpoint", inp.target_config), ("the draft model", inp.draft_config)):
        if not (cfg or {}).get("quantization_config"):
            continue
        if which == "--hf-checkpoint":
            try:
                fp8.Fp8BlockScheme.from_hf_config(cfg)
                continue
            except fp8.Fp8ConfigError as e:
                reason = str(e)
        else:
            reason = "a separate draft's weights are synced unquantized"
        out.append(Rule.MODEL_QUANTIZED_CHECKPOINT.finding(which=which, reason=reason))
    return out


def check_colocate(inp: CheckInput) -> list[Finding]:
    """Colocated SGLang releases engine memory around training; both switches below are needed for that."""
    if not inp.colocate or inp.debug_rollout_only:
        return []
    out = []
    if not inp.sglang.get("enable_memory_saver"):
        out.append(Rule.COLOCATE_MEMORY_SAVER.finding())
    if inp.algorithm is not None and inp.algorithm.uses_draft_model \
            and not inp.sglang.get("enable_draft_weights_cpu_backup"):
        out.append(Rule.COLOCATE_DRAFT_BACKUP.finding())
    return out


SGLANG_CORPUS_MAX_TOKENS = 10_000_000  # SGLang 0.5.23's --speculative-ngram-external-corpus-max-tokens default


def check_history(inp: CheckInput) -> list[Finding]:
    """--rollout-history-drafting: NGRAM on SGLang (corpora it actually drafts from); on the embedded engine NGRAM,
    or EAGLE/NEXTN (the hybrid drafter: MTP and history per row)."""
    if not inp.history_drafting:
        return []
    out = []
    if inp.history_epochs < 0 or inp.history_max_tokens < 1:
        out.append(Rule.SPEC_HISTORY_BOUNDS.finding(epochs=inp.history_epochs, max_tokens=inp.history_max_tokens))
    hybrid = inp.backend == "embedded" and inp.algorithm is Algorithm.EAGLE
    if inp.algorithm is not Algorithm.NGRAM and not hybrid:
        return out + [Rule.SPEC_HISTORY_NEEDS_NGRAM.finding(algorithm=inp.sglang.get("speculative_algorithm"))]
    if inp.backend != "sglang":
        return out
    tokens = inp.sglang.get("speculative_num_draft_tokens") or spec.NGRAM_DEFAULT_DRAFT_TOKENS
    budget = inp.sglang.get("speculative_ngram_external_sam_budget") or 0
    if budget < 1:
        out.append(Rule.SPEC_HISTORY_NO_SAM_BUDGET.finding(budget=budget, most=tokens - 1))
    elif budget > tokens - 1:
        out.append(Rule.SPEC_HISTORY_SAM_BUDGET_HIGH.finding(budget=budget, most=tokens - 1))
    corpus = inp.sglang.get("speculative_ngram_external_corpus_max_tokens") or SGLANG_CORPUS_MAX_TOKENS
    if inp.history_max_tokens * inp.prompts_per_rollout > corpus:
        out.append(Rule.SPEC_HISTORY_CORPUS_BUDGET.finding(per_prompt=inp.history_max_tokens,
                                                           prompts=inp.prompts_per_rollout, budget=corpus))
    return out
def check_sync_pipeline_parallel(inp: CheckInput) -> list[Finding]:
    """SGLang joins the weight-update group as rank_offset + tp_rank: pipeline stages of one engine collide."""
    pp = int(inp.sglang.get("pp_size") or 1)
    transport = inp.weight_sync_transport or ("tensor" if inp.colocate else "distributed")
    if pp > 1 and not inp.debug_rollout_only and transport == "distributed":
        return [Rule.SYNC_PIPELINE_PARALLEL.finding(pp=pp)]
    return []


def check_own_spec_options(inp: CheckInput) -> list[Finding]:
    """Our speculative options exist only in the embedded engine: real SGLang would refuse them at start."""
    own = [flag for flag, on in (("--spec-draft-sampling", inp.spec_draft_sampling), ("--spec-auto", inp.spec_auto))
           if on]
    if inp.backend == "sglang" and own:
        return [Rule.SPEC_OWN_OPTION_ON_SGLANG.finding(flags=" and ".join(own))]
    return []


def check_adaptive_recommended(inp: CheckInput) -> list[Finding]:
    """RL rollouts run at many batch sizes; a fixed draft length that pays at batch 1 costs at batch 64. Said when
    the draft length was left to SGLang's fixed default (a tuned --sglang-speculative-num-steps is left alone)."""
    config = inp.resolved[0]
    if config is None or config.speculative_adaptive or inp.spec_auto or inp.debug_rollout_only \
            or inp.sglang.get("speculative_num_steps") is not None:
        return []
    if config.speculative_algorithm in (Algorithm.EAGLE, Algorithm.EAGLE3) and config.speculative_eagle_topk == 1:
        auto = " (or --spec-auto on the embedded backend)" if inp.backend == "embedded" else ""
        return [Rule.SPEC_ADAPTIVE_RECOMMENDED.finding(auto=auto, steps=config.speculative_num_steps)]
    return []


def check_spec_running_requests(inp: CheckInput) -> list[Finding]:
    """SGLang resets an unset --max-running-requests to 48 with speculative decoding (the embedded engine too): a
    rollout that keeps more in flight on an engine then decodes in waves, each with its own tail."""
    n = inp.in_flight_per_engine
    if (not inp.sglang.get("speculative_algorithm") or "max_running_requests" in inp.sglang or n is None
            or n <= spec.SPEC_MAX_RUNNING_REQUESTS):
        return []
    return [Rule.SPEC_MAX_RUNNING_REQUESTS.finding(limit=spec.SPEC_MAX_RUNNING_REQUESTS, n=n)]


def run_checks(inp: CheckInput, shape_flags: dict | None = None) -> list[Finding]:
    findings: list[Finding] = []
    for check in (check_speculative, check_dtype, check_context_length, check_sglang_version, check_mtp_training,
                  check_draft_training, check_trainer_support, check_quantized_checkpoint, check_history,
                  check_own_spec_options, check_adaptive_recommended, check_sync_pipeline_parallel,
                  check_spec_running_requests):
        findings += check(inp)
    if inp.backend == "sglang":
        findings += check_flashinfer(inp) + check_cuda_graph_bs(inp) + check_colocate(inp)
    elif inp.sglang.get("speculative_algorithm"):
        findings.append(Rule.SGLANG_ONLY_CHECKS_SKIPPED.finding())
    if shape_flags:
        findings += check_model_flags(inp, shape_flags)
    return findings
