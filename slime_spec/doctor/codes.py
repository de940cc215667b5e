"""Every doctor finding, in one table: code, level, message template and fix template.

A check never writes a code or a message of its own; it picks a `Rule` and fills its fields:
`Rule.SPEC_NO_MTP.finding(algorithm="EAGLE", keys=...)`. One code may have several rules (the same
problem found in different ways, e.g. SPEC_TOPK_TOKENS), each with its own level and wording.
docs/{en,zh}/speculative.md list every code of this table (tests/test_spec.py checks it).

Templates are `str.format` strings. `{sg}` is the prefix of SGLang's flags where the reader types them:
`--sglang-` on slime-spec's command line (doctor, training), `--` on the embedded server's own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

LEVELS = ("error", "warning", "info")
SLIME_PREFIX = "--sglang-"   # how `slime-spec` / doctor spell SGLang's flags
SERVER_PREFIX = "--"         # how a server (SGLang's or the embedded one) spells them


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning" | "info"
    code: str
    message: str
    fix: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" + (f" (fix: {self.fix})" if self.fix else "")


@dataclass(frozen=True)
class _Entry:
    code: str
    level: str
    message: str
    fix: str = ""


class Rule(Enum):
    """One way a configuration goes wrong. `value` is its `_Entry`; `finding(**fields)` renders it."""

    # ---- speculative settings, found by slime_spec.speculative.settings.resolve (both backends)
    SPEC_UNKNOWN_ALGORITHM = _Entry(
        "SPEC_UNKNOWN_ALGORITHM", "error",
        "{sg}speculative-algorithm {name!r} is not an algorithm of SGLang 0.5.23 (it knows {known}; NEXTN is an "
        "alias of EAGLE)",
        "{sg}speculative-algorithm with one of {choices}")
    SPEC_UNSUPPORTED_ALGORITHM = _Entry(
        "SPEC_UNSUPPORTED_BY_BACKEND", "error",
        "the embedded engine does not implement speculative_algorithm={algorithm}{why}",
        "on a GPU node use --rollout-backend sglang; on CPU use {sg}speculative-algorithm with one of {choices}")
    SPEC_UNSUPPORTED_DRAFT_PATH = _Entry(
        "SPEC_UNSUPPORTED_BY_BACKEND", "error",
        "{algorithm} with {sg}speculative-draft-model-path {path}: the embedded engine drafts {algorithm} only "
        "with the target checkpoint's own MTP layers",
        "{sg}speculative-algorithm STANDALONE for a separate draft model, or drop {sg}speculative-draft-model-path")
    SPEC_TOPK_WITHOUT_STEPS = _Entry(
        "SPEC_TOPK_TOKENS", "error",
        "{sg}speculative-eagle-topk / {sg}speculative-num-draft-tokens are set without "
        "{sg}speculative-num-steps; SGLang then asserts at start (it chooses all three together, or none)",
        "set {sg}speculative-num-steps too (e.g. 3 with top-k 1 and 4 draft tokens), or none of the three")
    SPEC_STEPS_WITHOUT_TOPK = _Entry(
        "SPEC_TOPK_TOKENS", "error",
        "{sg}speculative-num-steps is set without {sg}speculative-eagle-topk; SGLang 0.5.23 then fails at start "
        "comparing the unset top-k (TypeError)",
        "{sg}speculative-eagle-topk 1 (a chain) or the top-k of the tree you want")
    SPEC_BELOW_ONE = _Entry(
        "SPEC_TOPK_TOKENS", "error",
        "{sg}speculative-num-steps, -eagle-topk and -num-draft-tokens must be >= 1 (got {steps} / {topk} / "
        "{tokens})",
        "e.g. {sg}speculative-num-steps 3 {sg}speculative-eagle-topk 1 {sg}speculative-num-draft-tokens 4")
    SPEC_CHAIN_OVERRIDE = _Entry(
        "SPEC_TOPK_TOKENS", "warning",
        "with {sg}speculative-eagle-topk 1 a chain of {steps} steps verifies speculative_num_steps + 1 = "
        "{need} tokens; SGLang silently overrides {sg}speculative-num-draft-tokens {tokens} to {need}",
        "{sg}speculative-num-draft-tokens {need}")
    SPEC_TREE_NEEDS_TOKENS = _Entry(
        "SPEC_TOPK_TOKENS", "error",
        "{sg}speculative-eagle-topk {topk} (a tree) without {sg}speculative-num-draft-tokens: SGLang does not "
        "choose it for a tree you shaped",
        "{sg}speculative-num-draft-tokens {need} or more")
    SPEC_TREE_CAPACITY = _Entry(
        "SPEC_TOPK_TOKENS", "error",
        "a tree of {steps} steps with top-k {topk} has at most {capacity} nodes (root included); "
        "{sg}speculative-num-draft-tokens {tokens} cannot be filled",
        "{sg}speculative-num-draft-tokens {capacity} or fewer")
    SPEC_TREE_TOO_FEW = _Entry(
        "SPEC_TOPK_TOKENS", "warning",
        "{tokens} draft tokens cannot hold one path of {steps} steps: most drafted steps are wasted",
        "{sg}speculative-num-draft-tokens {need} or more")
    SPEC_TREE_PAGE_SIZE = _Entry(
        "SPEC_TOPK_TOKENS", "error",
        "{what} > 1 with {sg}page-size {page} is only supported by the {backends} attention backend(s); "
        "SGLang refuses {backend}",
        "{sg}page-size 1 or {sg}attention-backend {suggested}")
    SPEC_NGRAM_TOO_FEW = _Entry(
        "SPEC_TOPK_TOKENS", "error",
        "NGRAM with {sg}speculative-num-draft-tokens {tokens}: the last verified token plus at least one draft "
        "are needed",
        "{sg}speculative-num-draft-tokens 2 or more (SGLang's default is 12)")
    SPEC_NO_MTP = _Entry(
        "SPEC_NO_MTP", "error",
        "{algorithm} without {sg}speculative-draft-model-path drafts with the target's native MTP layers, but the "
        "target's config.json has no MTP layers (no {keys})",
        "{sg}speculative-draft-model-path <an EAGLE draft>, or {sg}speculative-algorithm STANDALONE (with a "
        "draft) or NGRAM")
    SPEC_EAGLE3_NO_DRAFT = _Entry(
        "SPEC_EAGLE3_NO_DRAFT", "error",
        "EAGLE3 needs an external draft model ({sg}speculative-draft-model-path is unset)",
        "{sg}speculative-draft-model-path <EAGLE3 draft dir>")
    SPEC_STANDALONE_NO_DRAFT = _Entry(
        "SPEC_STANDALONE_NO_DRAFT", "error",
        "STANDALONE needs {sg}speculative-draft-model-path (a small model with the target's tokenizer)",
        "{sg}speculative-draft-model-path <small draft model dir>")
    SPEC_ADAPTIVE_DISABLED = _Entry(
        "SPEC_ADAPTIVE", "warning",
        "{sg}speculative-adaptive is turned off by SGLang: {reason}; static speculative parameters are used",
        "drop {sg}speculative-adaptive, or use EAGLE / EAGLE3 with {sg}speculative-eagle-topk 1")
    SPEC_ADAPTIVE_STEPS = _Entry(
        "SPEC_ADAPTIVE", "error",
        "{sg}speculative-num-steps {steps} is not among the adaptive candidate steps {candidates}; SGLang "
        "refuses to start",
        "{sg}speculative-num-steps with one of {candidates}, or leave it unset (SGLang then starts at {middle})")
    SPEC_ADAPTIVE_CONFIG = _Entry(
        "SPEC_ADAPTIVE", "error",
        "{sg}speculative-adaptive-config {path}: {problem}",
        "a JSON file of batch-size tiers, e.g. {{\"1\": {{\"candidate_steps\": [1, 3, 5]}}}}, or drop the flag "
        "for SGLang's default tiers")

    SPEC_OWN_OPTION_ON_SGLANG = _Entry(
        "SPEC_OWN_OPTION_ON_SGLANG", "error",
        "{flags}: slime-spec's own speculative options exist only in the embedded engine; SGLang's server would "
        "refuse them",
        "drop {flags}, or use --rollout-backend embedded; on SGLang, {sg}speculative-adaptive adapts the draft "
        "length")
    SPEC_MAX_RUNNING_REQUESTS = _Entry(
        "SPEC_MAX_RUNNING_REQUESTS", "warning",
        "speculative decoding with --sglang-max-running-requests unset: SGLang then runs at most {limit} requests at "
        "once, and this rollout keeps up to {n} in flight per engine, so its samples decode in waves (plain "
        "decoding would run them all at once)",
        "--sglang-max-running-requests {n}")
    SPEC_ADAPTIVE_RECOMMENDED = _Entry(
        "SPEC_ADAPTIVE_RECOMMENDED", "info",
        "the draft length is SGLang's fixed default ({steps} steps at every batch size); RL rollouts decode at batch "
        "sizes from the whole batch down to the last straggler, and a length that pays at small batches costs at "
        "large ones",
        "{sg}speculative-adaptive (SGLang's per-batch-size candidate steps){auto}")

    # ---- speculative settings vs the checkpoints and the GPU stack (slime_spec.doctor.spec_checks)
    SPEC_DTYPE_MISMATCH = _Entry(
        "SPEC_DTYPE_MISMATCH", "error",
        "the draft model is {draft} but the target is {target}, and --sglang-dtype is unset: SGLang then fails "
        "with 'Capture cuda graph failed'",
        "--sglang-dtype {draft}")
    SPEC_CONTEXT_DRAFT_SHORTER = _Entry(
        "SPEC_CONTEXT_LENGTH", "error",
        "the draft supports {draft} positions, the target {target}, and --sglang-context-length is {ctx}: SGLang "
        "requires draft and target context lengths to agree, and a mismatch can cause an illegal memory access "
        "(SGLang PR #9388)",
        "--sglang-context-length {draft}")
    SPEC_CONTEXT_PROMPT_TOO_LONG = _Entry(
        "SPEC_CONTEXT_LENGTH", "error",
        "the longest prompt ({prompt} tokens) plus --rollout-max-response-len ({response}) needs {need} positions "
        "but the context length is {ctx}",
        "lower --rollout-max-response-len to {fit}, set --rollout-max-prompt-len {limit} to leave the longer prompts "
        "out (the run counts them), or use a model with a longer context")
    SPEC_CONTEXT_RESPONSE_TOO_LONG = _Entry(
        "SPEC_CONTEXT_LENGTH", "error",
        "--rollout-max-response-len {response} alone reaches the context length {ctx}: no prompt fits beside it "
        "(the longest needs {need} positions)",
        "lower --rollout-max-response-len to at most {fit} (the longest prompt then fits), or use a model with a "
        "longer context")
    SPEC_CONTEXT_PROMPT_EXCEEDS = _Entry(
        "SPEC_CONTEXT_LENGTH", "error",
        "the longest prompt ({prompt} tokens) leaves no room for a response in the context length {ctx}: SGLang's "
        "scheduler refuses a prompt of {max_input} tokens or more (its max_req_input_len, the context length less "
        "6), so a shorter response than --rollout-max-response-len {response} cannot help",
        "--rollout-max-prompt-len {limit} leaves the longer prompts out (the run and doctor count them), or use a "
        "model with a longer context")
    SPEC_FLASHINFER = _Entry(
        "SPEC_FLASHINFER", "warning",
        "{why}: {algorithm} with flashinfer is exposed to CUDA-graph padding failures in the draft stage "
        "(SGLang #9888, #9521)",
        "--sglang-attention-backend fa3 (Hopper) or --sglang-attention-backend triton")
    SPEC_CUDA_GRAPH_BS = _Entry(
        "SPEC_CUDA_GRAPH_BS", "warning",
        "{problems}. CUDA-graph padding in the draft stage is a known failure with speculative decoding; "
        "--sglang-disable-cuda-graph-padding does not help with speculation",
        "--sglang-cuda-graph-bs-decode $(seq 1 32) $(seq 40 8 64) $(seq 80 16 160) (covering up to "
        "--sglang-max-running-requests)")
    SPEC_SGLANG_VERSION = _Entry(
        "SPEC_SGLANG_VERSION", "error",
        "an external draft model with SGLang {version}: releases before 0.5.1 hit an illegal memory access when "
        "draft and target context lengths differ (PR #9388)",
        "upgrade SGLang to 0.5.1 or newer")
    SPEC_MTP_TRAINING_NO_LAYERS = _Entry(
        "SPEC_MTP_TRAINING", "error",
        "--enable-mtp-training without --mtp-num-layers >= 1",
        "--mtp-num-layers 1 (the number of MTP layers in the checkpoint)")
    SPEC_MTP_TRAINING_NO_MTP = _Entry(
        "SPEC_MTP_TRAINING", "error",
        "--enable-mtp-training on a model whose config.json has no MTP layers",
        "use a model with native MTP layers (MiMo, DeepSeek-V3, GLM-4.5) or drop --enable-mtp-training")
    SPEC_MTP_TRAINING_TOO_MANY = _Entry(
        "SPEC_MTP_TRAINING", "error",
        "--mtp-num-layers {layers} but the checkpoint has {native} MTP layer(s)",
        "--mtp-num-layers {native}")
    SPEC_MTP_UNROLL_RECOMMENDED = _Entry(
        "SPEC_MTP_UNROLL_RECOMMENDED", "info",
        "{sg}speculative-num-steps {steps} drafts with {layers} MTP layer(s): steps past the last layer feed it its "
        "own hidden states, which --mtp-unroll-steps {unroll} does not train, and such steps are accepted less often",
        "--mtp-unroll-steps {need}")
    SPEC_DRAFT_TRAINING_NOT_EAGLE3 = _Entry(
        "SPEC_DRAFT_TRAINING", "error",
        "--enable-draft-training trains an EAGLE3 draft, but {sg}speculative-algorithm is {algorithm}",
        "{sg}speculative-algorithm EAGLE3 {sg}speculative-draft-model-path DRAFT, or drop --enable-draft-training "
        "(MTP layers train with --enable-mtp-training)")
    SPEC_DRAFT_TRAINING_NOT_EAGLE3_DRAFT = _Entry(
        "SPEC_DRAFT_TRAINING", "error",
        "--enable-draft-training: the draft's config.json has architectures {archs}, not LlamaForCausalLMEagle3",
        "point {sg}speculative-draft-model-path at an EAGLE3 draft (e.g. `slime-spec make-tiny-model --arch llama "
        "--num-layers 4 --eagle3-draft DIR` for a tiny one)")
    SPEC_DRAFT_TRAINING_AUX_LAYERS = _Entry(
        "SPEC_DRAFT_TRAINING", "error",
        "--enable-draft-training: the draft reads target layers {ids}, but SGLang captures distinct layers "
        "0..{last} of this {layers}-layer target",
        "set eagle_config.eagle_aux_hidden_state_layer_ids in the draft's config.json to three distinct layers "
        "0..{last}")
    SPEC_HISTORY_NEEDS_NGRAM = _Entry(
        "SPEC_HISTORY", "error",
        "--rollout-history-drafting drafts through NGRAM's external corpora (or, on the embedded backend, "
        "EAGLE/NEXTN's hybrid MTP + history drafter), but {sg}speculative-algorithm is {algorithm}",
        "{sg}speculative-algorithm NGRAM (either backend) or NEXTN (--rollout-backend embedded), or drop "
        "--rollout-history-drafting")
    SPEC_HISTORY_NO_SAM_BUDGET = _Entry(
        "SPEC_HISTORY", "error",
        "--rollout-history-drafting on SGLang with {sg}speculative-ngram-external-sam-budget {budget}: SGLang "
        "drafts no node from external corpora, so the history is never used",
        "{sg}speculative-ngram-external-sam-budget between 1 and {sg}speculative-num-draft-tokens - 1 ({most})")
    SPEC_HISTORY_SAM_BUDGET_HIGH = _Entry(
        "SPEC_HISTORY", "warning",
        "{sg}speculative-ngram-external-sam-budget {budget} is above {sg}speculative-num-draft-tokens - 1 "
        "({most}): SGLang caps it there, leaving no draft node to its shared n-gram trie",
        "{sg}speculative-ngram-external-sam-budget {most} or less")
    SPEC_HISTORY_CORPUS_BUDGET = _Entry(
        "SPEC_HISTORY", "warning",
        "--rollout-history-max-tokens {per_prompt} x --rollout-batch-size {prompts} prompts is over "
        "{sg}speculative-ngram-external-corpus-max-tokens {budget}: the one SGLang corpus keeps only the newest "
        "responses that fit",
        "raise {sg}speculative-ngram-external-corpus-max-tokens, or lower --rollout-history-max-tokens")
    SPEC_HISTORY_BOUNDS = _Entry(
        "SPEC_HISTORY", "error",
        "--rollout-history-epochs {epochs} / --rollout-history-max-tokens {max_tokens}: epochs must be >= 0 and "
        "max tokens >= 1",
        "--rollout-history-epochs 1 --rollout-history-max-tokens 8192 (the defaults)")
    SGLANG_ONLY_CHECKS_SKIPPED = _Entry(
        "SGLANG_ONLY_CHECKS_SKIPPED", "info",
        "backend embedded: the GPU-only checks SPEC_FLASHINFER and SPEC_CUDA_GRAPH_BS did not run",
        "pass --rollout-backend sglang to check the configuration as on a GPU node")

    # ---- model, trainer and colocation (slime_spec.doctor.spec_checks)
    MODEL_ARGS_MISMATCH = _Entry(
        "MODEL_ARGS_MISMATCH", "error", "{detail}",
        "make MODEL_ARGS match the checkpoint (scripts/models/*.sh) or point --hf-checkpoint at the right model")
    TRAINER_UNSUPPORTED_FAMILY = _Entry(
        "TRAINER_UNSUPPORTED_MODEL", "error",
        "the trainer builds Llama, Qwen2, Qwen3, Qwen3-MoE, MiMo, GLM-4.5, GLM-4.7-Flash and DeepSeek-V3 models; "
        "this checkpoint is {family}",
        "run rollouts alone with --debug-rollout-only, or train a Llama / Qwen2 / Qwen3 / MiMo / GLM-4.5 / "
        "GLM-4.7-Flash / DeepSeek-V3 model")
    TRAINER_MOE_TP_EP = _Entry(
        "TRAINER_UNSUPPORTED_MODEL", "error",
        "the experts of a {family} model: {why}",
        "the layout the message names, or run rollouts alone with --debug-rollout-only")
    TRAINER_EXPERT_PARALLEL = _Entry(
        "FLAG_CONFLICT", "error",
        "--expert-model-parallel-size {ep} with a {family} model: {why}",
        "{fix}")
    TRAINER_PIPELINE_LAYERS = _Entry(
        "FLAG_CONFLICT", "error",
        "pipeline stages for a {family} model: {why}",
        "a --pipeline-model-parallel-size (with --decoder-first-pipeline-num-layers or "
        "--decoder-last-pipeline-num-layers) that splits config.json's num_hidden_layers")
    TRAINER_UNSUPPORTED_ROPE = _Entry(
        "TRAINER_UNSUPPORTED_MODEL", "error",
        "rope_scaling type {rope_type!r} in a {family} checkpoint: the trainer implements plain RoPE, Llama-3.1's "
        "'llama3' scaling, and for DeepSeek-V3 'yarn' (megatron-core's multi-latent attention)",
        "run rollouts alone with --debug-rollout-only, or train a Llama / Qwen2 / Qwen3 / MiMo model")
    TRAINER_UNSUPPORTED_ACT = _Entry(
        "TRAINER_UNSUPPORTED_MODEL", "error",
        "hidden_act={act!r}: the trainer builds SwiGLU (silu) MLPs only",
        "run rollouts alone with --debug-rollout-only, or train a Llama / Qwen2 / Qwen3 / MiMo model")
    MODEL_QUANTIZED_CHECKPOINT = _Entry(
        "MODEL_QUANTIZED_CHECKPOINT", "error",
        "{which} has a quantization_config the weight sync does not reproduce ({reason}): SGLang serves it with "
        "quantized parameters and their scales, so after the first sync the engines would serve the new values "
        "under stale scales",
        "train from an unquantized (bf16) checkpoint, or from block-wise FP8 as DeepSeek-V3 ships it "
        "(quant_method fp8, activation_scheme dynamic, weight_block_size [128, 128]), which the sync quantizes "
        "with its scales; or run rollouts alone with --debug-rollout-only")
    COLOCATE_MEMORY_SAVER = _Entry(
        "COLOCATE_MEMORY_SAVER", "warning",
        "--colocate without SGLang's memory saver (--no-offload-rollout): release_memory_occupation then frees "
        "nothing, and the trainer and the engines compete for GPU memory",
        "drop --no-offload-rollout (colocated engines then start with --enable-memory-saver, as in slime), or "
        "--sglang-enable-memory-saver")
    COLOCATE_DRAFT_BACKUP = _Entry(
        "COLOCATE_DRAFT_BACKUP", "warning",
        "--colocate with a draft model and no --sglang-enable-draft-weights-cpu-backup: the draft's weights may "
        "not survive a release/resume cycle and acceptance silently collapses to ~1.0 (slime forces this "
        "switch; watch spec_canary_accept_length after resume too)",
        "--sglang-enable-draft-weights-cpu-backup")
    SYNC_PIPELINE_PARALLEL = _Entry(
        "SYNC_PIPELINE_PARALLEL", "error",
        "{sg}pp-size {pp} with the distributed weight sync: SGLang 0.5.23 joins every scheduler of an engine to the "
        "weight-update group as rank rank_offset + tp_rank (model_runner_components/weight_updater.py), without its "
        "pipeline rank, so the {pp} pipeline stages of an engine claim the same ranks and the group cannot form",
        "{sg}pp-size 1 (an engine's GPUs as tensor parallelism, --rollout-num-gpus-per-engine), or "
        "--weight-sync-transport disk")

    # ---- files and flags (slime_spec.doctor.diagnose)
    CONFIG_MISSING = _Entry(
        "CONFIG_UNREADABLE", "error", "{what}: {path} does not exist",
        "point the flag at a local HF model directory containing config.json")
    CONFIG_BROKEN = _Entry(
        "CONFIG_UNREADABLE", "error", "{what}: cannot read {path} ({error})",
        "fix or re-download the checkpoint's config.json")
    PROMPT_DATA_MISSING = _Entry(
        "PROMPT_DATA_UNREADABLE", "error", "--prompt-data {path} does not exist", "pass a local JSONL file")
    PROMPT_DATA_INVALID = _Entry(
        "PROMPT_DATA_UNREADABLE", "error", "{error}",
        "fix each line named (by its line number and field), or set --input-key / --label-key to the right fields")
    PROMPTS_DROPPED = _Entry(
        "PROMPTS_DROPPED", "warning",
        "--rollout-max-prompt-len {limit} leaves out {dropped} of {total} prompts of --prompt-data (the longest has "
        "{longest} tokens)",
        "raise --rollout-max-prompt-len (within the context length) to keep them, or drop them from the file")
    PROMPTS_ALL_DROPPED = _Entry(
        "PROMPTS_DROPPED", "error",
        "--rollout-max-prompt-len {limit} leaves out every one of the {total} prompts of --prompt-data (the longest "
        "has {longest} tokens)",
        "raise --rollout-max-prompt-len, or use shorter prompts")
    OUTPUT_NOT_WRITABLE = _Entry(
        "OUTPUT_NOT_WRITABLE", "error", "{flag} {path}: {why}; the run would fail at its first write",
        "choose a directory this user can write, or fix its permissions")
    OUTPUT_NO_ROOM = _Entry(
        "OUTPUT_NO_ROOM", "error",
        "--save {path}: {free} free on its filesystem ({base}), and one checkpoint of this model takes about {need} "
        "(weights, AdamW state and fp32 masters, estimated from the --hf-checkpoint safetensors)",
        "free space there, or give a --save on a filesystem with room")
    CHECKPOINT_WOULD_OVERWRITE = _Entry(
        "CHECKPOINT_WOULD_OVERWRITE", "error", "{error}", "as the message says")
    PROMPT_LENGTH_UNCHECKED = _Entry(
        "PROMPT_LENGTH_UNCHECKED", "info", "no tokenizer next to --hf-checkpoint; prompt lengths not checked")
    ARGS_ERROR = _Entry("ARGS_ERROR", "error", "{error}")
    FLAG_NOT_HONOURED = _Entry(
        "FLAG_NOT_HONOURED", "info", "accepted, no effect here ({why}): {flags}")
    FLAG_NOT_SUPPORTED = _Entry(
        "FLAG_NOT_SUPPORTED", "error", "{flag}{value}: not supported here ({why}); the run would not be the one "
        "you asked for", "{fix}")
    SGLANG_FLAG_RENAMED = _Entry(
        "SGLANG_FLAG_RENAMED", "warning",
        "{old} does not exist in SGLang {version}; it was renamed and is forwarded as {new}",
        "write {new} in SGLANG_ARGS")
    UNKNOWN_FLAG = _Entry(
        "UNKNOWN_FLAG", "error", "{flag} is not a flag slime-spec knows (it parses slime's flags and the Megatron "
        "flags of slime's scripts){hint}",
        "fix the spelling, or pass --allow-unknown-flags if it is your own flag")
    UNKNOWN_FLAG_ALLOWED = _Entry(
        "UNKNOWN_FLAG", "warning", "{flag} is not a flag slime-spec knows{hint}; ignored (--allow-unknown-flags)",
        "remove it if it is a typo")
    FLAG_OUT_OF_RANGE = _Entry(
        "FLAG_OUT_OF_RANGE", "error", "{flag} {value}: {must}", "{fix}")
    FLAG_CONFLICT = _Entry(
        "FLAG_CONFLICT", "error", "{problem}", "{fix}")
    REF_LOAD_UNREADABLE = _Entry(
        "REF_LOAD_UNREADABLE", "error", "--ref-load {path} {problem}; the trainer reads the KL reference from an HF "
        "directory or a slime-spec checkpoint",
        "--ref-load <the reference model's HF directory>, or drop --ref-load: the reference is then --hf-checkpoint "
        "(the model slime's scripts convert to torch_dist)")
    RM_TYPE_UNKNOWN = _Entry(
        "RM_TYPE_UNKNOWN", "error", "--rm-type {name!r} is not a reward function slime-spec has (it has {known})",
        "--rm-type with one of {known}, or --custom-rm-path <module.fn> for your own")
    GPUS_UNAVAILABLE = _Entry(
        "GPUS_UNAVAILABLE", "error", "{requested} GPU(s) requested ({detail}) but {where} has {available}",
        "lower --actor-num-gpus-per-node / --rollout-num-gpus, use --colocate, or run where the GPUs are "
        "(RAY_ADDRESS of a cluster that has them)")
    GPUS_NOT_CHECKED = _Entry(
        "GPUS_NOT_CHECKED", "info", "{requested} GPU(s) requested ({detail}); this machine has {available} and "
        "{ray}, so GPU counts were not checked against the cluster the run will use",
        "set RAY_ADDRESS to that cluster to check against it")
    BACKEND_EMBEDDED = _Entry(
        "BACKEND_EMBEDDED", "info", "no CUDA GPU with a full SGLang here: engines use the embedded backend",
        "on a GPU node the same flags start sglang.launch_server")
    EMBEDDED_FLAG_REFUSED = _Entry(
        "EMBEDDED_FLAG_REFUSED", "error",
        "the embedded engine cannot honour these SGLang flags: {flags}",
        "remove them, or run this configuration on backend sglang (--rollout-backend sglang) on a GPU node")

    @property
    def code(self) -> str:
        return self.value.code

    @property
    def level(self) -> str:
        return self.value.level

    def finding(self, *, sg: str = SLIME_PREFIX, **fields) -> Finding:
        """Render this rule; `sg` is the SGLang flag prefix the reader types (see the module docstring)."""
        e = self.value
        return Finding(e.level, e.code, e.message.format(sg=sg, **fields), e.fix.format(sg=sg, **fields))


CODES: frozenset[str] = frozenset(r.code for r in Rule)


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]
