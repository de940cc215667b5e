"""Speculative decoding's settings: one typed config, resolved once, the way SGLang 0.5.23 resolves them.

`resolve(server_args)` is the only place that applies SGLang's defaults and rules to the
`--sglang-speculative-*` flags; doctor (both backends) and the embedded engine call it, and everything
downstream reads the frozen `SpecConfig` it returns. Field names are SGLang's ServerArgs dest names, so
`--sglang-speculative-num-steps` is `speculative_num_steps` from the flag to the drafter.

The rules follow sglang/srt/arg_groups/speculative_hook.py (`handle_speculative_decoding`,
`_resolve_speculative_algorithm_alias`, `_handle_eagle_family`, `_auto_choose_speculative_params`,
`_handle_ngram`, `_maybe_disable_adaptive`, `_init_adaptive_speculative_params`) and
sglang/srt/speculative/adaptive_spec_params.py. Where SGLang fails later (a crash, an assert) or
silently rewrites a value, resolve says so as a finding. FROZEN_KV_MTP, DFLASH, UNO and DSPARK take
their shape from the draft checkpoint inside SGLang; their values pass through unchanged.

Pure (reads at most the adaptive-config JSON file); no torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from enum import StrEnum

from slime_spec.doctor.codes import SERVER_PREFIX, SLIME_PREFIX, Finding, Rule, errors


class Algorithm(StrEnum):
    """SGLang 0.5.23's built-in algorithms (sglang/srt/speculative/spec_info.py `SpeculativeAlgorithm`)."""

    EAGLE = "EAGLE"
    EAGLE3 = "EAGLE3"
    STANDALONE = "STANDALONE"
    NGRAM = "NGRAM"
    FROZEN_KV_MTP = "FROZEN_KV_MTP"
    DFLASH = "DFLASH"
    UNO = "UNO"
    DSPARK = "DSPARK"

    @classmethod
    def parse(cls, name: str) -> "Algorithm":
        """Case-insensitive, aliases applied (NEXTN is EAGLE); ValueError for a name SGLang does not know."""
        upper = str(name).upper()
        upper = ALIASES.get(upper, upper)
        if upper not in cls.__members__:
            raise ValueError(f"unknown speculative algorithm {name!r}")
        return cls[upper]

    @property
    def eagle_family(self) -> bool:
        """Resolved by SGLang's `_handle_eagle_family` (num_steps / eagle_topk / num_draft_tokens)."""
        return self in (Algorithm.EAGLE, Algorithm.EAGLE3, Algorithm.STANDALONE)

    @property
    def uses_draft_model(self) -> bool:
        """A draft runner with weights exists (everything but NGRAM's token matching)."""
        return self is not Algorithm.NGRAM

    @property
    def can_draft_with_target_mtp(self) -> bool:
        """Without a draft path, the draft is the target checkpoint's own MTP layers (EAGLE/NEXTN, FROZEN_KV_MTP)."""
        return self in (Algorithm.EAGLE, Algorithm.FROZEN_KV_MTP)


ALIASES = {"NEXTN": "EAGLE"}  # sglang/srt/speculative/spec_registry.py _RESERVED_ALIASES
# What the embedded engine implements: EAGLE with the target's own (MiMo) MTP layers, STANDALONE, NGRAM.
EMBEDDED_ALGORITHMS = frozenset({Algorithm.EAGLE, Algorithm.EAGLE3, Algorithm.STANDALONE, Algorithm.NGRAM})

# SGLang 0.5.23 defaults and constants (tests/test_spec.py compares them with the installed SGLang).
NGRAM_DEFAULT_DRAFT_TOKENS = 12
NGRAM_MAX_BFS_BREADTH = 10           # --speculative-ngram-max-bfs-breadth default; NGRAM's top-k
NGRAM_MAX_TRIE_DEPTH = 18            # --speculative-ngram-max-trie-depth default
SPEC_MAX_RUNNING_REQUESTS = 48       # max_running_requests when unset and speculation is on
PAGED_TREE_BACKENDS = ("flashinfer", "fa3", "triton")  # top-k > 1 with page_size > 1 (eagle family)
PAGED_NGRAM_BACKENDS = ("flashinfer",)                 # the same for NGRAM
TREE_DEFAULT_ARCHS = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")  # auto (5, 4, 8)
# Adaptive speculation's default tiers: batch size -> candidate num_steps.
ADAPTIVE_TIERS = {1: (1, 3, 5, 7), 8: (0, 1, 3), 32: (0, 1), 64: (0,)}
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


class SpecError(ValueError):
    """A speculative configuration that cannot run; the message holds each finding's code, text and fix."""


@dataclass(frozen=True)
class SpecConfig:
    """Resolved speculative settings, named as SGLang names them. Build it with `resolve()`.

    num_steps / eagle_topk / num_draft_tokens are None only for the algorithms whose shape SGLang takes
    from the draft checkpoint (FROZEN_KV_MTP, DFLASH, UNO, DSPARK) when the user left them unset.
    """

    speculative_algorithm: Algorithm
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_draft_model_path: str | None = None
    speculative_ngram_max_bfs_breadth: int = NGRAM_MAX_BFS_BREADTH
    speculative_ngram_max_trie_depth: int = NGRAM_MAX_TRIE_DEPTH
    speculative_adaptive: bool = False
    speculative_adaptive_config: str | None = None

    def __post_init__(self):
        if not isinstance(self.speculative_algorithm, Algorithm):
            object.__setattr__(self, "speculative_algorithm", Algorithm.parse(self.speculative_algorithm))

    @property
    def num_steps(self) -> int:
        """The draft tokens one verify pass checks, the verified root excluded (num_draft_tokens - 1): what the
        embedded engine's step policy and drafters call `num_steps`.

        For a top-k 1 chain it is speculative_num_steps. NGRAM verifies num_draft_tokens nodes, the root included
        (sglang/srt/speculative/ngram_worker.py), and its speculative_num_steps (num_draft_tokens // breadth) sizes
        nothing it drafts, so NGRAM's is num_draft_tokens - 1; so is a tree's (top-k > 1).
        """
        if self.speculative_num_draft_tokens is None:
            raise SpecError(f"speculative_algorithm={self.speculative_algorithm}: speculative_num_draft_tokens is "
                            "unset (SGLang derives it from the draft checkpoint)")
        return self.speculative_num_draft_tokens - 1

    def server_args(self) -> dict:
        """The SGLang dest -> value form, as `resolve()` takes it (resolve(c.server_args()) gives c back)."""
        return {**asdict(self), "speculative_algorithm": str(self.speculative_algorithm)}


SPEC_DESTS = tuple(f.name for f in fields(SpecConfig))


def native_mtp_layers(cfg: dict | None) -> int:
    if not cfg:
        return 0
    return max(int(cfg.get(k) or 0) for k in MTP_CONFIG_KEYS)


def model_arch(cfg: dict | None) -> str | None:
    return ((cfg or {}).get("architectures") or [None])[0]


def adaptive_candidate_steps(config_path: str | None) -> list[int]:
    """The union of every batch-size tier's candidate_steps (SGLang's defaults, or the JSON file's)."""
    if config_path is None:
        tiers = {str(bs): {"candidate_steps": list(steps)} for bs, steps in ADAPTIVE_TIERS.items()}
    else:
        try:
            with open(config_path) as f:
                tiers = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read it ({e})") from e
        if not isinstance(tiers, dict):
            raise ValueError("it is not a JSON object of batch-size tiers")
    steps: set[int] = set()
    for key, tier in tiers.items():
        if not key.isdigit():
            continue
        candidates = tier.get("candidate_steps") if isinstance(tier, dict) else None
        if not isinstance(candidates, list) or not candidates or \
                not all(isinstance(s, int) and s >= 0 for s in candidates):
            raise ValueError(f"tier {key}: candidate_steps must be a non-empty list of non-negative ints, "
                             f"got {candidates!r}")
        steps.update(candidates)
    if not steps:
        raise ValueError(f"no batch-size tier (an integer key such as \"1\"); keys are {list(tiers)}")
    return sorted(steps)


def auto_shape(algorithm: Algorithm, arch: str | None) -> tuple[int, int, int]:
    """(num_steps, eagle_topk, num_draft_tokens) SGLang picks when none of the three is set."""
    if algorithm is Algorithm.STANDALONE or arch not in TREE_DEFAULT_ARCHS:
        return 3, 1, 4
    return 5, 4, 8


def _adaptive_unsupported_reason(algorithm: Algorithm, topk: int | None, sa: dict) -> str | None:
    if algorithm not in (Algorithm.EAGLE, Algorithm.EAGLE3):
        return f"speculative_algorithm={algorithm} (only EAGLE/EAGLE3 are supported)"
    if topk is not None and topk != 1:
        return f"speculative_eagle_topk={topk} (only topk=1 is supported)"
    if (sa.get("attn_dp_size") or 1) > 1 or sa.get("enable_dp_attention"):  # the flag SGLang 0.5.23 deprecates
        return "attention DP is not supported"
    for dest, why in (("enable_multi_layer_eagle", "enable_multi_layer_eagle=True is not supported"),
                      ("enable_two_batch_overlap", "enable_two_batch_overlap=True is not supported"),
                      ("enable_pdmux", "enable_pdmux=True is not supported")):
        if sa.get(dest):
            return why
    return None


@dataclass
class _Shape:
    steps: int | None
    topk: int | None
    tokens: int | None
    adaptive: bool


def _resolve_adaptive(algorithm: Algorithm, shape: _Shape, sa: dict, sg: str) -> list[Finding]:
    reason = _adaptive_unsupported_reason(algorithm, shape.topk, sa)
    if reason is not None:
        shape.adaptive = False
        return [Rule.SPEC_ADAPTIVE_DISABLED.finding(sg=sg, reason=reason)]
    path = sa.get("speculative_adaptive_config")
    try:
        candidates = adaptive_candidate_steps(path)
    except ValueError as e:
        return [Rule.SPEC_ADAPTIVE_CONFIG.finding(sg=sg, path=path, problem=str(e))]
    middle = candidates[len(candidates) // 2]
    shape.topk = 1 if shape.topk is None else shape.topk
    shape.steps = middle if shape.steps is None else shape.steps
    if shape.steps not in candidates:
        return [Rule.SPEC_ADAPTIVE_STEPS.finding(sg=sg, steps=shape.steps, candidates=candidates, middle=middle)]
    shape.tokens = shape.steps + 1
    return []


def _paged_tree(what: str, page: int, attention: str | None, allowed: tuple[str, ...], sg: str) -> list[Finding]:
    if page <= 1 or attention is None or attention in allowed:
        return []
    return [Rule.SPEC_TREE_PAGE_SIZE.finding(sg=sg, what=what, page=page, backends=" / ".join(allowed),
                                             backend=attention, suggested=allowed[-1])]


def _resolve_eagle_family(algorithm: Algorithm, shape: _Shape, arch: str | None, sa: dict, backend: str,
                          sg: str) -> list[Finding]:
    if not shape.adaptive and shape.steps is None:
        if shape.topk is not None or shape.tokens is not None:
            return [Rule.SPEC_TOPK_WITHOUT_STEPS.finding(sg=sg)]
        shape.steps, shape.topk, shape.tokens = auto_shape(algorithm, arch)
    steps, topk, tokens = shape.steps, shape.topk, shape.tokens
    if topk is None:
        return [Rule.SPEC_STEPS_WITHOUT_TOPK.finding(sg=sg)]
    if steps < 1 or topk < 1 or (tokens is not None and tokens < 1):
        return [Rule.SPEC_BELOW_ONE.finding(sg=sg, steps=steps, topk=topk, tokens=tokens)]
    out = []
    if topk == 1:
        if tokens is not None and tokens != steps + 1:
            out.append(Rule.SPEC_CHAIN_OVERRIDE.finding(sg=sg, steps=steps, tokens=tokens, need=steps + 1))
        shape.tokens = steps + 1
        return out
    capacity = topk + (steps - 1) * topk * topk + 1
    if tokens is None:
        out.append(Rule.SPEC_TREE_NEEDS_TOKENS.finding(sg=sg, topk=topk, need=steps + 1))
    elif tokens > capacity:
        out.append(Rule.SPEC_TREE_CAPACITY.finding(sg=sg, steps=steps, topk=topk, tokens=tokens, capacity=capacity))
    elif tokens <= steps:
        out.append(Rule.SPEC_TREE_TOO_FEW.finding(sg=sg, steps=steps, tokens=tokens, need=steps + 1))
    if backend == "sglang":
        out += _paged_tree(f"top-k {topk}", sa.get("page_size") or 1, sa.get("attention_backend"),
                           PAGED_TREE_BACKENDS, sg)
    return out


def _resolve_ngram(shape: _Shape, breadth: int, sa: dict, backend: str, sg: str) -> list[Finding]:
    shape.topk = breadth
    shape.tokens = NGRAM_DEFAULT_DRAFT_TOKENS if shape.tokens is None else shape.tokens
    if shape.steps is None:
        shape.steps = shape.tokens // shape.topk
    out = []
    if shape.tokens < 2:
        out.append(Rule.SPEC_NGRAM_TOO_FEW.finding(sg=sg, tokens=shape.tokens))
    if backend == "sglang" and breadth > 1:
        out += _paged_tree(f"NGRAM's top-k ({sg}speculative-ngram-max-bfs-breadth {breadth})",
                           sa.get("page_size") or 1, sa.get("attention_backend"), PAGED_NGRAM_BACKENDS, sg)
    return out


def _draft_findings(algorithm: Algorithm, draft_path: str | None, target_config: dict | None,
                    sg: str) -> list[Finding]:
    if draft_path:
        return []
    if algorithm is Algorithm.EAGLE3:
        return [Rule.SPEC_EAGLE3_NO_DRAFT.finding(sg=sg)]
    if algorithm is Algorithm.STANDALONE:
        return [Rule.SPEC_STANDALONE_NO_DRAFT.finding(sg=sg)]
    if algorithm is Algorithm.EAGLE and target_config is not None and native_mtp_layers(target_config) == 0:
        return [Rule.SPEC_NO_MTP.finding(sg=sg, algorithm=algorithm, keys=" / ".join(MTP_CONFIG_KEYS))]
    return []


def _embedded_findings(config: SpecConfig, sg: str) -> list[Finding]:
    algorithm = config.speculative_algorithm
    choices = ", ".join(sorted(EMBEDDED_ALGORITHMS)) + " (NEXTN is EAGLE)"
    if algorithm not in EMBEDDED_ALGORITHMS:
        return [Rule.SPEC_UNSUPPORTED_ALGORITHM.finding(sg=sg, algorithm=algorithm, why="", choices=choices)]
    out = []
    if algorithm is Algorithm.EAGLE and config.speculative_draft_model_path:
        out.append(Rule.SPEC_UNSUPPORTED_DRAFT_PATH.finding(sg=sg, algorithm=algorithm,
                                                           path=config.speculative_draft_model_path))
    return out


def resolve(server_args: dict, *, target_config: dict | None, backend: str,
            sg: str = SLIME_PREFIX) -> tuple[SpecConfig | None, list[Finding]]:
    """SGLang's resolution of the speculative flags, once, for backend "sglang" or "embedded".

    server_args: SGLang dest -> value (unset flags absent or None). target_config: the target's
    config.json (architecture and native MTP layers; None when unknown). sg: the SGLang flag prefix the
    messages use (`--sglang-` for slime-spec's command line, `--` for a server's).
    Returns (config, findings); config is None without speculation or when a finding is an error.
    """
    name = server_args.get("speculative_algorithm")
    if name in (None, ""):
        return None, []
    try:
        algorithm = Algorithm.parse(name)
    except ValueError:
        choices = EMBEDDED_ALGORITHMS if backend == "embedded" else list(Algorithm)
        return None, [Rule.SPEC_UNKNOWN_ALGORITHM.finding(
            sg=sg, name=name, known=", ".join(Algorithm), choices=", ".join(sorted(choices)))]
    get = server_args.get
    shape = _Shape(get("speculative_num_steps"), get("speculative_eagle_topk"), get("speculative_num_draft_tokens"),
                   bool(get("speculative_adaptive")))
    breadth = get("speculative_ngram_max_bfs_breadth") or NGRAM_MAX_BFS_BREADTH
    depth = get("speculative_ngram_max_trie_depth") or NGRAM_MAX_TRIE_DEPTH
    draft_path = get("speculative_draft_model_path") or None
    findings = _draft_findings(algorithm, draft_path, target_config, sg)
    if shape.adaptive:
        findings += _resolve_adaptive(algorithm, shape, server_args, sg)
    if algorithm.eagle_family:
        findings += _resolve_eagle_family(algorithm, shape, model_arch(target_config), server_args, backend, sg)
    elif algorithm is Algorithm.NGRAM:
        findings += _resolve_ngram(shape, breadth, server_args, backend, sg)
    config = SpecConfig(algorithm, shape.steps, shape.topk, shape.tokens, draft_path, breadth, depth,
                        shape.adaptive, get("speculative_adaptive_config"))
    if backend == "embedded":
        findings = _embedded_findings(config, sg) + findings
    if errors(findings):
        return None, findings
    object.__setattr__(config, "_resolved_for", backend)  # not a field: equality and server_args() ignore it
    return config, findings


def resolve_or_raise(server_args: dict, *, target_config: dict | None = None, backend: str = "embedded",
                     sg: str = SERVER_PREFIX) -> SpecConfig | None:
    """`resolve()`, raising SpecError on an error finding (the embedded engine's entry point)."""
    config, findings = resolve(server_args, target_config=target_config, backend=backend, sg=sg)
    bad = errors(findings)
    if bad:
        raise SpecError("; ".join(map(str, bad)))
    return config


def check_resolved(config: SpecConfig, *, target_config: dict | None, backend: str = "embedded",
                   sg: str = SERVER_PREFIX) -> None:
    """Raise SpecError unless `config` is what `resolve()` makes of its own fields, without an error.

    Lets code that builds a SpecConfig by hand (tests, benchmarks) reach an engine only in resolved form. A config
    `resolve()` returned for this backend passes without resolving again: the settings are validated once per
    process.
    """
    if getattr(config, "_resolved_for", None) == backend:
        return
    resolved, findings = resolve(config.server_args(), target_config=target_config, backend=backend, sg=sg)
    bad = errors(findings)
    if bad:
        raise SpecError("; ".join(map(str, bad)))
    if resolved != config:
        why = "; ".join(map(str, findings)) or f"it resolves to {resolved}"
        raise SpecError(f"speculative settings {config.server_args()} are not resolved: {why}. Build them with "
                        "slime_spec.speculative.settings.resolve()")
