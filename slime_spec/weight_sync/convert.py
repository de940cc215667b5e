"""Megatron-core GPTModel parameter names and layouts <-> HF names and layouts, per model family.

Pure functions, no process state: the weight sync calls `megatron_to_hf` on full (TP-gathered)
tensors, the trainer's loader calls `hf_to_megatron` on an HF state dict.

Layouts that are not a rename:
- `linear_qkv` fuses q, k, v *per query group*: rows are [q_g0 (heads_per_group*d), k_g0 (d), v_g0 (d),
  q_g1, ...], so a TP shard holds whole groups. Same for its bias.
- `linear_fc1` (SwiGLU) is [gate; up]. Under TP each rank holds [gate_shard; up_shard], so gathering it is
  not a plain concatenation: `merge_tp_shards` regroups it.
- MTP `eh_proj` takes cat([enorm(embedding), hnorm(hidden)]). DeepSeek-V3 / GLM-4.5 `eh_proj` use the same
  order (sglang deepseek_nextn.py, glm4_moe_nextn.py); MiMo's `input_proj` takes
  cat([hidden_layernorm(hidden), token_layernorm(embedding)]) (sglang mimo_mtp.py), so its column halves swap.
- Megatron may pad the vocabulary to a multiple of the TP size; HF tensors are cut to `vocab_size`.

HF homes of the MTP layers: MiMo `model.mtp_layers.{i}.*`; DeepSeek-V3 / GLM-4.5
`model.layers.{num_hidden_layers + i}.*` with enorm, hnorm, eh_proj, shared_head.norm. Llama, Qwen2 and Qwen3
checkpoints have no MTP layers.

Qwen3's per-head q/k RMSNorm (`self_attn.q_norm`, `k_norm`, [head_dim]) is megatron-core's `q_layernorm` /
`k_layernorm`: one weight shared by every head, so every TP rank holds all of it. MoE layers (Qwen3-MoE, DeepSeek-V3,
GLM-4.5): the router is `mlp.gate`, each expert `mlp.experts.{e}.{gate,up,down}_proj` (megatron-core's sequential
`local_experts`, fc1 = [gate; up] as a dense MLP's).
"""

from __future__ import annotations

import re
from typing import TypeVar

import torch

from slime_spec.common.model_families import (
    FAMILIES,
    FAMILY_OF_ARCHITECTURE,
    MLA_FAMILIES,
    MOE_FAMILIES,
    MTP_FAMILIES,
    NEXTN_FAMILIES,
)

T = TypeVar("T")

# Megatron layer-relative name -> HF layer-relative name, for tensors that are a pure rename.
# Both the local-spec spellings (input_layernorm, pre_mlp_layernorm) and the TransformerEngine fused
# spellings (...layer_norm_weight) are accepted; hf_to_megatron emits the local ones.
_COMMON_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_QK_NORM_LAYER = {  # GQA with per-head q/k norm (Qwen3, Qwen3-MoE, GLM-4.5 use_qk_norm)
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_MLA_LAYER = {  # DeepSeek-V3 multi-latent attention: every tensor keeps its layout
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
_MOE_LAYER = {  # sequential (local) experts; megatron's router bias is DeepSeek's e_score_correction_bias
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_FUSED_FC1 = {  # megatron fc1 prefix -> HF mlp prefix; fc1 = [gate; up]
    "mlp.linear_fc1.weight": "mlp.",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.",
}
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")

_EXPERT_INDEX = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
_MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight")
_MIMO_MTP = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
             "eh_proj.weight": "input_proj.weight", "final_layernorm.weight": "final_layernorm.weight"}
_DEEPSEEK_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                 "eh_proj.weight": "eh_proj.weight", "final_layernorm.weight": "shared_head.norm.weight"}


def family_of(hf_config: dict) -> str:
    """The conversion family of an HF config (its model_type, or its architecture)."""
    model_type = hf_config.get("model_type")
    if model_type in FAMILIES:
        return model_type
    for arch in hf_config.get("architectures") or ():
        if arch in FAMILY_OF_ARCHITECTURE:
            return FAMILY_OF_ARCHITECTURE[arch]
    raise ValueError(f"unsupported model: model_type={model_type!r}, architectures={hf_config.get('architectures')}; "
                     f"supported model_type values: {', '.join(FAMILIES)}")


def strip_wrappers(name: str) -> str:
    """Drop the `module.` prefixes DDP / Float16Module wrappers add."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def is_mtp_param(megatron_name: str) -> bool:
    return strip_wrappers(megatron_name).startswith("mtp.")


def num_experts(hf_config: dict) -> int:
    """Routed experts per MoE layer of an HF config (0 for a dense one)."""
    return int(hf_config.get("num_experts") or hf_config.get("n_routed_experts") or 0)


def expert_index(megatron_name: str) -> int | None:
    """The expert number in a routed expert's Megatron name (`...local_experts.{i}...`), None for other names."""
    m = _EXPERT_INDEX.search(megatron_name)
    return int(m.group(2)) if m else None


def tp_split_of(megatron_name: str, tensor_parallel: T, expert_tensor_parallel: T | None) -> T:
    """Which split a parameter's TP shards follow: a routed expert's the expert-TP ranks' (when given; None: the
    TP ranks, Megatron's default), every other parameter's the TP ranks'. Pass (rank, size) or (group, size)."""
    if expert_tensor_parallel is not None and expert_index(megatron_name) is not None:
        return expert_tensor_parallel
    return tensor_parallel


def with_expert_index(megatron_name: str, index: int) -> str:
    """The same routed-expert parameter name with expert number `index` (a local number <-> the global one)."""
    return _EXPERT_INDEX.sub(lambda m: f"{m.group(1)}{index}{m.group(3)}", megatron_name, count=1)


def global_expert_name(megatron_name: str, ep_rank: int, ep_size: int, hf_config: dict) -> str:
    """A routed expert's name with its global number: EP rank r holds experts r * E / ep_size onwards as
    `local_experts.0, 1, ...` (megatron-core's layout); other names unchanged."""
    local = expert_index(megatron_name)
    if local is None or ep_size == 1:
        return megatron_name
    return with_expert_index(megatron_name, ep_rank * (num_experts(hf_config) // ep_size) + local)


def tp_split_dim(megatron_name: str) -> int | None:
    """The dim a tensor-parallel parameter is split on, None when every TP rank holds all of it."""
    name = strip_wrappers(megatron_name)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    leaf = name.split(".", 3)[-1] if name.startswith(("decoder.layers.", "mtp.layers.")) else name
    if leaf.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if leaf.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "eh_proj.weight",
                      "linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
                      "linear_kv_down_proj.weight", "linear_kv_up_proj.weight")):
        return 0
    if leaf.endswith(("norm.weight", "layer_norm_weight", "router.weight", "router.expert_bias",
                      "final_layernorm.weight")):
        return None
    raise ValueError(f"tp_split_dim: unknown Megatron parameter {megatron_name!r}")


def merge_tp_shards(megatron_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the TP shards of one parameter, in TP rank order."""
    dim = tp_split_dim(megatron_name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if strip_wrappers(megatron_name).endswith("linear_fc1.weight"):  # each shard is [gate_i; up_i]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def split_tp_shard(megatron_name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The inverse of `merge_tp_shards`: rank `tp_rank`'s shard of a full tensor."""
    dim = tp_split_dim(megatron_name)
    if dim is None or tp_size == 1:
        return full
    if strip_wrappers(megatron_name).endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    if full.shape[dim] % tp_size:
        raise ValueError(f"{megatron_name}: dim {dim} of size {full.shape[dim]} does not divide by "
                         f"tensor_model_parallel_size={tp_size}")
    return full.chunk(tp_size, dim=dim)[tp_rank]


def _attention_dims(hf_config: dict) -> tuple[int, int, int]:
    heads = hf_config["num_attention_heads"]
    groups = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    return heads, groups, head_dim


def _layer_renames(family: str) -> dict[str, str]:
    renames = dict(_COMMON_LAYER)
    if family in MLA_FAMILIES:
        renames.update(_MLA_LAYER)
    if family in ("qwen3", "qwen3_moe", "glm4_moe"):
        renames.update(_QK_NORM_LAYER)
    if family in MOE_FAMILIES:
        renames.update(_MOE_LAYER)
    return renames


def _layer_to_hf(family: str, rest: str, tensor: torch.Tensor, hf_config: dict, prefix: str,
                 full_name: str) -> list[tuple[str, torch.Tensor]]:
    renames = _layer_renames(family)
    if rest in renames:
        return [(prefix + renames[rest], tensor)]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias") and family not in MLA_FAMILIES:
        heads, groups, head_dim = _attention_dims(hf_config)
        per_group = heads // groups
        grouped = tensor.reshape(groups, per_group + 2, head_dim, *tensor.shape[1:])
        q, k, v = torch.split(grouped, [per_group, 1, 1], dim=1)
        kind = rest.rsplit(".", 1)[1]
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t.reshape(-1, *tensor.shape[1:]).contiguous())
                for p, t in (("q", q), ("k", k), ("v", v))]
    if rest in _FUSED_FC1 and (rest == "mlp.linear_fc1.weight" or family in MOE_FAMILIES):
        gate, up = tensor.chunk(2, dim=0)
        hf = prefix + _FUSED_FC1[rest]
        return [(hf + "gate_proj.weight", gate.contiguous()), (hf + "up_proj.weight", up.contiguous())]
    expert = _EXPERT.fullmatch(rest)
    if expert and family in MOE_FAMILIES:
        hf = f"{prefix}mlp.experts.{expert.group(1)}."
        if expert.group(2) == "linear_fc2":
            return [(hf + "down_proj.weight", tensor)]
        gate, up = tensor.chunk(2, dim=0)
        return [(hf + "gate_proj.weight", gate.contiguous()), (hf + "up_proj.weight", up.contiguous())]
    raise ValueError(f"megatron_to_hf({family}): unknown Megatron parameter {full_name!r}")


def megatron_to_hf(family: str, name: str, tensor: torch.Tensor, hf_config: dict) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one full Megatron parameter; unknown names raise ValueError."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    name = strip_wrappers(name)
    vocab = hf_config["vocab_size"]
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[:vocab])]
    if name == "output_layer.weight":
        return [("lm_head.weight", tensor[:vocab])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    if m := _LAYER.fullmatch(name):
        return _layer_to_hf(family, m.group(2), tensor, hf_config, f"model.layers.{m.group(1)}.", name)
    if m := _MTP.fullmatch(name):
        i, rest = int(m.group(1)), m.group(2)
        if family not in MTP_FAMILIES:
            raise ValueError(f"megatron_to_hf({family}): {name!r} is an MTP layer, but {family} checkpoints have "
                             f"no MTP layers; use a family with MTP ({', '.join(MTP_FAMILIES)}) or mtp_num_layers=0")
        if family == "mimo":
            prefix, own = f"model.mtp_layers.{i}.", _MIMO_MTP
        else:
            prefix, own = f"model.layers.{hf_config['num_hidden_layers'] + i}.", _DEEPSEEK_MTP
        if rest in own:
            if rest == "eh_proj.weight" and family == "mimo":
                embedding_half, hidden_half = tensor.chunk(2, dim=1)
                tensor = torch.cat([hidden_half, embedding_half], dim=1)
            return [(prefix + own[rest], tensor)]
        if rest.startswith("transformer_layer."):
            return _layer_to_hf(family, rest[len("transformer_layer."):], tensor, hf_config, prefix, name)
    raise ValueError(f"megatron_to_hf({family}): unknown Megatron parameter {name!r}")


def _hf_rename_table(family: str) -> dict[str, str]:
    """HF layer-relative name -> Megatron layer-relative name (local-spec spelling)."""
    table = {}
    for mg, hf in _layer_renames(family).items():
        if "layer_norm_weight" not in mg:  # the TE spelling is accepted one way only
            table[hf] = mg
    return table


def hf_to_megatron(family: str, hf_state: dict[str, torch.Tensor], hf_config: dict) -> dict[str, torch.Tensor]:
    """The Megatron (local spec) state dict of an HF state dict; unknown HF names raise ValueError.

    Not carried: DeepSeek-V3's per-MTP-layer copies of the embedding and head
    (`model.layers.{N+i}.embed_tokens`, `.shared_head.head`), because Megatron's MTP shares the main model's.
    A tied `lm_head.weight` is not carried either (Megatron shares the embedding).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    n_layers = hf_config["num_hidden_layers"]
    tied = bool(hf_config.get("tie_word_embeddings", False))
    renames = _hf_rename_table(family)
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}  # fused megatron name -> {"q"/"k"/"v"/"gate"/"up": tensor}

    def put_layer(mg_prefix: str, rest: str, tensor: torch.Tensor, hf_name: str) -> None:
        if rest in renames:
            out[mg_prefix + renames[rest]] = tensor
            return
        if family not in MLA_FAMILIES and (m := re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", rest)):
            parts.setdefault(f"{mg_prefix}self_attention.linear_qkv.{m.group(2)}", {})[m.group(1)] = tensor
            return
        if m := re.fullmatch(r"mlp\.(shared_experts\.)?(gate|up)_proj\.weight", rest):
            if m.group(1) and family not in MOE_FAMILIES:
                raise ValueError(f"hf_to_megatron({family}): unknown HF parameter {hf_name!r}")
            fc1 = f"{mg_prefix}mlp.{m.group(1) or ''}linear_fc1.weight"
            parts.setdefault(fc1, {})[m.group(2)] = tensor
            return
        if family in MOE_FAMILIES and (
                m := re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", rest)):
            expert = f"{mg_prefix}mlp.experts.local_experts.{m.group(1)}."
            if m.group(2) == "down":
                out[expert + "linear_fc2.weight"] = tensor
            else:
                parts.setdefault(expert + "linear_fc1.weight", {})[m.group(2)] = tensor
            return
        raise ValueError(f"hf_to_megatron({family}): unknown HF parameter {hf_name!r}")

    own_inverse = {v: k for k, v in (_MIMO_MTP if family == "mimo" else _DEEPSEEK_MTP).items()}

    def put_mtp(index: int, rest: str, tensor: torch.Tensor, hf_name: str) -> None:
        prefix = f"mtp.layers.{index}."
        if rest in own_inverse:
            if own_inverse[rest] == "eh_proj.weight" and family == "mimo":
                hidden_half, embedding_half = tensor.chunk(2, dim=1)
                tensor = torch.cat([embedding_half, hidden_half], dim=1)
            out[prefix + own_inverse[rest]] = tensor
        else:
            put_layer(prefix + "transformer_layer.", rest, tensor, hf_name)

    for hf_name, tensor in hf_state.items():
        if hf_name == "model.embed_tokens.weight":
            out["embedding.word_embeddings.weight"] = tensor
        elif hf_name == "lm_head.weight":
            if not tied:
                out["output_layer.weight"] = tensor
        elif hf_name == "model.norm.weight":
            out["decoder.final_layernorm.weight"] = tensor
        elif family == "mimo" and (m := re.fullmatch(r"model\.mtp_layers\.(\d+)\.(.+)", hf_name)):
            put_mtp(int(m.group(1)), m.group(2), tensor, hf_name)
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name):
            i, rest = int(m.group(1)), m.group(2)
            if i < n_layers:
                put_layer(f"decoder.layers.{i}.", rest, tensor, hf_name)
            elif family in NEXTN_FAMILIES:
                if rest not in ("embed_tokens.weight", "shared_head.head.weight"):
                    put_mtp(i - n_layers, rest, tensor, hf_name)
            else:
                raise ValueError(f"hf_to_megatron({family}): {hf_name!r} is past num_hidden_layers={n_layers}")
        else:
            raise ValueError(f"hf_to_megatron({family}): unknown HF parameter {hf_name!r}")

    heads, groups, head_dim = _attention_dims(hf_config)
    for mg_name, p in parts.items():
        if mg_name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            if set(p) != {"q", "k", "v"}:
                raise ValueError(f"hf_to_megatron({family}): {mg_name} needs q, k and v; got only {sorted(p)}")
            tail = p["q"].shape[1:]
            q = p["q"].reshape(groups, heads // groups, head_dim, *tail)
            k = p["k"].reshape(groups, 1, head_dim, *tail)
            v = p["v"].reshape(groups, 1, head_dim, *tail)
            out[mg_name] = torch.cat([q, k, v], dim=1).reshape(-1, *tail).contiguous()
        else:
            if set(p) != {"gate", "up"}:
                raise ValueError(f"hf_to_megatron({family}): {mg_name} needs gate and up; got only {sorted(p)}")
            out[mg_name] = torch.cat([p["gate"], p["up"]], dim=0)
    return out

