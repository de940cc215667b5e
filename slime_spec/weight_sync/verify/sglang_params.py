"""HF-named tensors -> the parameters SGLang's model classes serve, and their checksums by SGLang's own hash.

What a sync sends is checkpoint-named (convert.py); what SGLang's `/weights_checker {"action": "checksum"}`
hashes is every parameter of each runner's model as SGLang builds it (utils/weight_checker.py):

- q/k/v stacked into `qkv_proj` and gate/up into `gate_up_proj` (the models' `stacked_params_mapping`, shared experts'
  gate/up too); DeepSeek-V3's MLA down projections `q_a_proj` and `kv_a_proj_with_mqa` stacked into
  `fused_qkv_a_proj_with_mqa` (models/deepseek_common/deepseek_weight_loader.py; `kv_b_proj` stays a parameter, the
  `w_kc` / `w_vc` SGLang splits from it after a load are plain attributes, never hashed);
- the routed experts of Qwen3-MoE, DeepSeek-V3 and GLM-4.5 stacked per layer into `FusedMoE`'s two parameters
  (layers/moe/fused_moe_triton, `make_expert_params_mapping` and `_load_w13`): `mlp.experts.w13_weight`
  `[experts, 2 * moe_intermediate, hidden]`, each expert's gate rows then its up rows, and `mlp.experts.w2_weight`
  `[experts, hidden, moe_intermediate]` (down), in expert order; the router stays `mlp.gate.weight` (with
  `e_score_correction_bias` for DeepSeek-V3 and GLM-4.5); SGLang holds the correction bias in float32, and GLM-4.5's
  router weight too (`MoEGate`, `Glm4MoeGate`), whatever the engine's dtype;
- the embedding and an untied lm_head padded to SGLang's vocabulary padding (`VocabParallelEmbedding`'s
  `pad_vocab_size`), the padding rows zero (its weight loader fills them); a tied lm_head is the embedding's
  module and listed once, as `model.embed_tokens.weight`;
- MiMo's MTP draft runner (`MiMoMTP`, models/mimo_mtp.py) renames `model.mtp_layers.{i}.` to `model.` for its
  own norms and `input_proj`, to `model.mtp_block.` for the decoder layer; its embedding and lm_head are the
  target's (`set_embed_and_head`). SGLang's MiMoMTP has one block: a later MTP layer overwrites an earlier one;
- DeepSeek-V3's, GLM-4.5's and GLM-4.7-Flash's NextN draft runners (`DeepseekV3ForCausalLMNextN`,
  `Glm4MoeForCausalLMNextN`, `Glm4MoeLiteForCausalLMNextN`) load
  the one MTP layer `model.layers.{num_hidden_layers}`: its enorm / hnorm / eh_proj / shared_head.norm as `model.`,
  the rest as `model.decoder.`, its own embedding and head copies skipped for the target's (`set_embed_and_head`);
  the target runner skips every layer from `num_hidden_layers` on;
- an EAGLE3 draft (`LlamaForCausalLMEagle3`, models/llama_eagle3.py) renames `midlayer` to `layers.0`, prefixes
  `model.`, takes the target's embedding (`set_embed`), keeps its own lm_head over the draft vocabulary, and holds
  d2t / t2d outside its parameters;
- every other tensor in the engine's own dtype; rotary caches and other derived buffers are skipped by SGLang.

`ServedChecksums` streams sent tensors into exactly those served tensors (a fused parameter waits for its parts,
one layer's at most) and hashes each with `sglang.srt.managers.mm_utils.tensor_hash`, SGLang's own function, on
the CPU (a sha256 of the raw bytes): what an engine on device cpu answers. On CUDA SGLang hashes with a Triton
kernel instead, so these checksums are compared with CPU engines only (weight_sync/verify/readback.py). Tensor-parallel
shards are
not modelled (TP 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch

from slime_spec.common.model_families import FAMILIES, NEXTN_FAMILIES
from slime_spec.weight_sync.fp8 import FP8_DTYPE, SCALE_SUFFIX

# (fused name, parts in stacked order), as SGLang's models declare stacked_params_mapping
STACKED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")),
           ("fused_qkv_a_proj_with_mqa", ("q_a_proj", "kv_a_proj_with_mqa")))
VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")  # padded to SGLang's vocabulary padding
MTP_OWN = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")  # MiMoMTP's `model.` names
_MTP_LAYER = re.compile(r"^model\.mtp_layers\.\d+\.")
# FusedMoE's parameters: (fused name, each expert's parts in stacked order)
EXPERT_STACKED = (("w13_weight", ("gate_proj", "up_proj")), ("w2_weight", ("down_proj",)))
_EXPERT_PART = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_EXPERT_FUSED = re.compile(r"\.experts\.(w13_weight|w2_weight)(_scale_inv)?$")  # an FP8 model's scales too
_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# DeepSeek-V3 / GLM-4.5: MTP layers at model.layers.{num_hidden_layers + i}; the NextN loaders' own names
# (`nextn_spec_weight_names`, matched as substrings as SGLang does) and the copies they skip.
NEXTN_OWN = ("shared_head.norm", "eh_proj", "enorm", "hnorm")
NEXTN_SKIPPED = ("shared_head.head", "embed_tokens")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
# Parameters SGLang allocates in float32 whatever the engine's dtype (name suffixes, per model type).
FLOAT32_PARAMS = {"deepseek_v3": ("mlp.gate.e_score_correction_bias",),
                  "glm4_moe": ("mlp.gate.weight", "mlp.gate.e_score_correction_bias"),
                  "glm4_moe_lite": ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")}

# Runner kinds: the target (a Llama-style causal LM: llama, qwen2, qwen3, mimo; and qwen3_moe, deepseek_v3,
# glm4_moe), MiMo's MTP draft, DeepSeek-V3's / GLM-4.5's NextN draft, an EAGLE3 draft; a STANDALONE draft is a
# `causal_lm` of its own config.
CAUSAL_LM, MIMO_MTP, NEXTN, EAGLE3 = "causal_lm", "mimo_mtp", "nextn", "eagle3"


@dataclass(frozen=True)
class RunnerLayout:
    """How one SGLang runner serves a model: which class (`kind`), whether its lm_head is its embedding, the
    engine's dtype (None: keep the tensors' own), the routed experts per MoE layer (0: dense), the first checkpoint
    layer that is an MTP layer (`model.layers.{mtp_layer}`; None: the MTP layers live elsewhere or not at all) and
    the parameters SGLang keeps in float32 (name suffixes). Vocabulary rows are padded from the tensors' own row
    counts, which SGLang's weight loader requires to equal the model's vocabulary."""

    kind: str
    tie_word_embeddings: bool = False
    dtype: torch.dtype | None = None
    num_experts: int = 0
    mtp_layer: int | None = None
    float32: tuple[str, ...] = ()

    @classmethod
    def target(cls, hf_config: dict, dtype: torch.dtype | None) -> "RunnerLayout":
        model_type = hf_config.get("model_type")
        experts = {"qwen3_moe": "num_experts", "deepseek_v3": "n_routed_experts",
                   "glm4_moe": "n_routed_experts", "glm4_moe_lite": "n_routed_experts"}.get(model_type)
        mtp_layer = int(hf_config["num_hidden_layers"]) if model_type in NEXTN_FAMILIES else None
        return cls(CAUSAL_LM, bool(hf_config.get("tie_word_embeddings", False)), dtype,
                   int(hf_config.get(experts) or 0) if experts else 0, mtp_layer, FLOAT32_PARAMS.get(model_type, ()))

    @classmethod
    def mtp_draft(cls, hf_config: dict, dtype: torch.dtype | None) -> "RunnerLayout":
        """The draft runner of a model's own MTP layers: MiMoMTP, or for DeepSeek-V3 / GLM-4.5 the NextN class."""
        model_type = hf_config.get("model_type")
        tied = bool(hf_config.get("tie_word_embeddings", False))
        if model_type not in NEXTN_FAMILIES:
            return cls(MIMO_MTP, tied, dtype)
        layers = int(hf_config["num_hidden_layers"])
        return cls(NEXTN, tied, dtype, int(hf_config.get("n_routed_experts") or 0),
                   0 if layers == 1 else layers,  # SGLang's `nextn_layer_id` ("compatible with old design")
                   FLOAT32_PARAMS[model_type])

    @classmethod
    def eagle3_draft(cls, dtype: torch.dtype | None) -> "RunnerLayout":
        return cls(EAGLE3, False, dtype)


# Model types whose served layout this module reproduces; others' checksums are not predicted.
MODELLED_TYPES = FAMILIES


def sync_roles(hf_config: dict, dtype: torch.dtype | None, *, mtp_draft: bool) -> dict[str, RunnerLayout] | None:
    """The runners a sync of this checkpoint writes, by role: the target, and MiMo's MTP draft runner when the MTP
    layers are sent to it (`mtp_draft`); None for a model type whose served layout is not modelled."""
    model_type = hf_config.get("model_type")
    if model_type not in MODELLED_TYPES:
        return None
    roles = {"target": RunnerLayout.target(hf_config, dtype)}
    if mtp_draft:
        if model_type not in ("mimo", *NEXTN_FAMILIES):
            return None
        roles["draft"] = RunnerLayout.mtp_draft(hf_config, dtype)
    return roles


def separate_draft_role(algorithm: str | None, dtype: torch.dtype | None) -> dict[str, RunnerLayout] | None:
    """The draft runner a trained separate draft's own tensors go to: EAGLE3 (`LlamaForCausalLMEagle3`); None for
    any other algorithm (its layout is not modelled)."""
    if str(algorithm or "").upper() == "EAGLE3":
        return {"draft": RunnerLayout.eagle3_draft(dtype)}
    return None


def fuse(name: str) -> tuple[str, int]:
    """(the fused name a stacked part loads into, the part's index); (name, 0) for any other name. An expert's
    part is at index expert * parts per expert + its place among them (w13: gate 2e, up 2e + 1; w2: down e)."""
    m = _EXPERT_PART.search(name)
    if m is not None:
        expert, part = int(m.group(1)), m.group(2)
        for fused, parts in EXPERT_STACKED:
            if part in parts:
                return f"{name[:m.start()]}.experts.{fused}{m.group(3) or ''}", expert * len(parts) + parts.index(part)
    for fused, parts in STACKED:
        for index, part in enumerate(parts):
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), index
    return name, 0


def stacked_parts(served: str, num_experts: int = 0) -> list[str] | None:
    """The part names, in stacked order, of a fused served name; None if it is not fused (an experts' parameter
    is fused only given the layer's `num_experts`)."""
    m = _EXPERT_FUSED.search(served)
    if m is not None:
        if not num_experts:
            return None
        parts = dict(EXPERT_STACKED)[m.group(1)]
        return [f"{served[:m.start()]}.experts.{e}.{p}.weight{m.group(2) or ''}" for e in range(num_experts)
                for p in parts]
    for fused, parts in STACKED:
        if f".{fused}." in served:
            return [served.replace(f".{fused}.", f".{p}.") for p in parts]
    return None


def sent_expert_parts(served: str, sent: set[str]) -> list[str] | None:
    """The parts of an experts' parameter (`...mlp.experts.w13_weight`) for every expert up to the highest one of
    that layer in `sent`: what a coverage check over a reply that lists names only (not the expert count) can ask
    for; None for any other name or where no expert of that layer was sent."""
    m = _EXPERT_FUSED.search(served)
    if m is None:
        return None
    layer = served[:m.start()] + ".experts."
    ids = [int(e.group(1)) for n in sent if n.startswith(layer) and (e := _EXPERT_PART.search(n))]
    return stacked_parts(served, max(ids) + 1) if ids else None


def served_name(hf_name: str, layout: RunnerLayout) -> tuple[str, int] | None:
    """(served name, index of this part in its fused parameter) in a runner of `layout`; None if that runner's
    `load_weights` does not load `hf_name` (SGLang skips it)."""
    if any(s in hf_name for s in _SKIPPED):
        return None
    if layout.tie_word_embeddings and hf_name == "lm_head.weight":
        return None  # SGLang's loaders skip it: the lm_head is the embedding
    if layout.kind == CAUSAL_LM:
        if hf_name.startswith("model.mtp_layers."):
            return None  # MiMoForCausalLM.load_weights leaves the MTP layers to the draft runner
        m = _LAYER_INDEX.match(hf_name)
        if layout.mtp_layer is not None and m is not None and int(m.group(1)) >= layout.mtp_layer:
            return None  # DeepSeek-V3 / GLM-4.5 loaders leave the MTP layers to the NextN draft runner
        return fuse(hf_name)
    if layout.kind == NEXTN:
        if hf_name in VOCAB_ROWS:
            return hf_name, 0  # the target's, shared (set_embed_and_head)
        prefix = f"model.layers.{layout.mtp_layer}."
        if not hf_name.startswith(prefix) or any(s in hf_name for s in NEXTN_SKIPPED):
            return None
        rest = hf_name[len(prefix):]
        if any(own in rest for own in NEXTN_OWN):
            return "model." + rest, 0
        return fuse("model.decoder." + rest)
    if layout.kind == MIMO_MTP:
        if hf_name in VOCAB_ROWS:
            return hf_name, 0
        m = _MTP_LAYER.match(hf_name)
        if m is None:
            return None  # the draft runner keeps only its block, norms, input_proj, embedding and lm_head
        rest = hf_name[m.end():]
        if any(rest.startswith(own + ".") for own in MTP_OWN):
            return "model." + rest, 0
        return fuse("model.mtp_block." + rest)
    if layout.kind == EAGLE3:
        if hf_name in ("d2t", "t2d") or hf_name.endswith((".d2t", ".t2d")):
            return None  # d2t becomes hot_token_id (not a parameter), t2d is dropped
        name = hf_name.replace("midlayer", "layers.0")
        if name == "model.embed_tokens.weight" or name == "lm_head.weight":
            return name, 0
        return fuse(name if name.startswith("model.") else "model." + name)
    raise ValueError(f"unknown runner kind {layout.kind!r}; expected {CAUSAL_LM}, {MIMO_MTP}, {NEXTN} or {EAGLE3}")


def fused_parts(served: str, index: int, layout: RunnerLayout) -> list[str] | None:
    """`stacked_parts` of a served name a runner of `layout` loads part `index` into; refuses an expert's tensor the
    layout has no place for (no or fewer experts), which would otherwise hash a wrong tensor."""
    parts = stacked_parts(served, layout.num_experts)
    m = _EXPERT_FUSED.search(served)
    if m is not None and (parts is None or index >= len(parts)):
        expert = index // len(dict(EXPERT_STACKED)[m.group(1)])
        raise ValueError(f"{served}: expert {expert}'s weight for a runner of num_experts={layout.num_experts}; "
                         "build the RunnerLayout from the model's config.json (RunnerLayout.target reads "
                         "num_experts)")
    return parts


def padded_rows(served: str, rows: int) -> int | None:
    """Rows SGLang allocates for a vocabulary-sized parameter of `rows` vocabulary rows (None for any other):
    `VocabParallelEmbedding`'s padding, at TP 1."""
    if served not in VOCAB_ROWS:
        return None
    _importable()
    from sglang.srt.layers.vocab_parallel_embedding import DEFAULT_VOCAB_PADDING_SIZE, pad_vocab_size

    return pad_vocab_size(rows, DEFAULT_VOCAB_PADDING_SIZE)


def stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along rows; without a copy where the parts already are consecutive rows of one tensor (the
    embedded engine on CUDA keeps q/k/v and gate/up as views of its fused projections)."""
    first = parts[0].detach()
    end = first.data_ptr()
    for p in parts:
        if (not p.is_contiguous() or p.data_ptr() != end or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return torch.cat(parts, dim=0)
        end += p.numel() * p.element_size()
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


def served_value(served: str, parts: list[torch.Tensor], layout: RunnerLayout) -> torch.Tensor:
    """The tensor SGLang serves under `served`, from its parts in stacked order: stacked (an experts' parameter:
    each expert's parts stacked, the experts along a new first dimension), cast to the engine's dtype (an FP8
    weight and its scale keep theirs), vocabulary rows padded with zeros."""
    m = _EXPERT_FUSED.search(served)
    if m is not None:
        group = len(dict(EXPERT_STACKED)[m.group(1)])
        t = torch.stack([stacked(parts[i:i + group]) if group > 1 else parts[i].detach()
                         for i in range(0, len(parts), group)])
    else:
        t = (parts[0] if len(parts) == 1 else stacked(parts)).detach()
    if t.dtype == FP8_DTYPE or served.endswith(SCALE_SUFFIX):
        pass  # an FP8 checkpoint's weight and its float32 block scale, loaded as they are
    elif served.endswith(layout.float32):
        t = t.to(torch.float32)
    elif layout.dtype is not None:
        t = t.to(layout.dtype)
    rows = padded_rows(served, t.shape[0])
    if rows is not None and rows != t.shape[0]:
        t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], dim=0)
    return t.contiguous()


def served_tensors(named: Iterable[tuple[str, torch.Tensor]], layout: RunnerLayout) -> dict[str, torch.Tensor]:
    """Every parameter a runner of `layout` serves after loading `named` (SGLang's names, values and dtype).
    Parts of a fused parameter must all be present; a later tensor of the same served name wins (load order)."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in named:
        mapped = served_name(hf_name, layout)
        if mapped is None:
            continue
        name, index = mapped
        parts = fused_parts(name, index, layout)
        if parts is None:
            out[name] = served_value(name, [tensor], layout)
            continue
        got = pending.setdefault(name, {})
        got[index] = tensor
        if len(got) == len(parts):
            out[name] = served_value(name, [got[i] for i in range(len(parts))], layout)
            del pending[name]
    if pending:
        raise ValueError(f"fused parameters with missing parts: "
                         f"{ {n: sorted(p) for n, p in list(pending.items())[:4]} } "
                         "(send every q/k/v, gate/up, q_a/kv_a and every expert's gate/up/down)")
    return out


def _importable() -> None:
    """SGLang's layer and manager modules import torchvision, stood in for where it cannot import
    (engine/sglang_stand_ins.py)."""
    from slime_spec.engine import sglang_stand_ins
    sglang_stand_ins.install()


def sglang_tensor_hash():
    """SGLang's own tensor hash, `sglang.srt.managers.mm_utils.tensor_hash` (what its WeightChecker calls)."""
    _importable()
    from sglang.srt.managers.mm_utils import tensor_hash

    return tensor_hash


def served_dtype(hf_config: dict, dtype: str) -> torch.dtype:
    """The dtype SGLang serves a checkpoint in for `--dtype dtype`: SGLang's own rule
    (`configs/model_config._get_and_verify_dtype`; 'auto' is the checkpoint's dtype, float32 served as float16)."""
    _importable()
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    return _get_and_verify_dtype(hf_config, dtype)


def checksum(tensor: torch.Tensor) -> str:
    """A served tensor's checksum as SGLang's WeightChecker writes it: tensor_hash as 16 hex digits."""
    return f"{sglang_tensor_hash()(tensor):016x}"


def quantized_checksum(weight: torch.Tensor, scale: torch.Tensor) -> str:
    """An FP8 parameter's checksum as SGLang's WeightChecker writes it: the hash of its bfloat16 dequantization by
    SGLang's own `Fp8BlockComparable` (utils/weight_checker_comparator.py); the scale gets no entry of its own."""
    _importable()
    from sglang.srt.utils.weight_checker_comparator import Fp8BlockComparable

    return checksum(Fp8BlockComparable(weight, scale).dequantize())


class ServedChecksums:
    """Checksums of what each runner serves after loading the tensors streamed through `add`, keyed as SGLang's
    `/weights_checker` keys them: per role, served names (a draft role's keys unprefixed here).

    A fused parameter's parts are held until all arrived (one layer's q/k/v, gate/up or experts at most), so the
    model is never copied whole. `roles`: role -> RunnerLayout of the runners the sync writes."""

    def __init__(self, roles: dict[str, RunnerLayout]):
        self.roles = roles
        self.checksums: dict[str, dict[str, str]] = {role: {} for role in roles}
        self._pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        self._quantized: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (role, weight) -> weight / scale

    def add(self, hf_name: str, tensor: torch.Tensor) -> None:
        for role, layout in self.roles.items():
            mapped = served_name(hf_name, layout)
            if mapped is None:
                continue
            name, index = mapped
            parts = fused_parts(name, index, layout)
            tensor = tensor.detach().cpu()
            if parts is None:
                self._served(role, name, served_value(name, [tensor], layout))
                continue
            got = self._pending.setdefault((role, name), {})
            got[index] = tensor
            if len(got) == len(parts):
                self._served(role, name, served_value(name, [got[i] for i in range(len(parts))], layout))
                del self._pending[(role, name)]

    def _served(self, role: str, name: str, value: torch.Tensor) -> None:
        """Hash a complete served tensor; an FP8 weight and its scale are hashed together, under the weight's name,
        once both are complete (SGLang's WeightChecker hashes the pair's dequantization)."""
        if value.dtype != FP8_DTYPE and not name.endswith(SCALE_SUFFIX):
            self.checksums[role][name] = checksum(value)
            return
        weight = name.removesuffix(SCALE_SUFFIX)
        pair = self._quantized.setdefault((role, weight), {})
        pair["scale" if name.endswith(SCALE_SUFFIX) else "weight"] = value
        if len(pair) == 2:
            self.checksums[role][weight] = quantized_checksum(pair["weight"], pair["scale"])
            del self._quantized[(role, weight)]

    def payload_keys(self) -> dict[str, str]:
        """The checksums keyed as SGLang's merged `/weights_checker` payload keys them (`_merge_checksum_payloads`):
        the target's names bare, a draft role's prefixed with the role."""
        return {(n if role == "target" else f"{role}.{n}"): c for role, names in self.checksums.items()
                for n, c in names.items()}

    def incomplete(self) -> list[str]:
        """Fused parameters some of whose parts were never sent, FP8 weights sent without their scale or the
        reverse (`role:name`)."""
        unpaired = [f"{role}:{weight} ({', '.join(pair)} only)" for (role, weight), pair in self._quantized.items()]
        return sorted([f"{role}:{name}" for role, name in self._pending] + unpaired)
