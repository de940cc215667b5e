"""The embedded engine's model configuration: `ModelArgs`, each family's shapes and differences read from an HF
config.json (engine/model_executor/model.py builds the modules from it), and the RoPE tables its forwards read."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from slime_spec.common import model_families as families
from slime_spec.common import rope as rope_math
from slime_spec.engine.model_executor.mla import MLA_ARCHITECTURES, MLAArgs, mla_fields
from slime_spec.engine.model_executor.moe import moe_fields

SUPPORTED_ARCHITECTURES = families.architectures(families.FAMILIES)
QK_NORM_ARCHITECTURES = families.architectures(families.QK_NORM_FAMILIES)
# MTP layers as SGLang's NextN draft classes read them: decoder layers past the last, `model.layers.{N + i}`
NEXTN_ARCHITECTURES = families.architectures(families.NEXTN_FAMILIES)
MTP_ARCHITECTURES = families.architectures(families.MTP_FAMILIES)


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mtp_layers: int
    rope_llama3: tuple[tuple[str, float], ...] | None = None  # Llama-3.1's rope_scaling fields (common/rope.py)
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head (weights [head_dim]) before RoPE
    num_experts: int = 0  # Qwen3-MoE: routed experts per layer (0: dense MLPs)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    grouped_topk: bool = False  # GLM-4.5's routing and shared experts (moe.GroupedTopkMoeBlock), fields below
    first_k_dense_replace: int = 0  # layers before this one have a dense MLP
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    router_float32: bool = True  # the grouped router's weight in float32 (GLM-4.5), else the model's dtype
    rotary_dim: int = 0  # the leading dims of each head RoPE rotates (GLM-4.5: a partial_rotary_factor); 0: all
    nextn_mtp: bool = False  # MTP layers are `model.layers.{num_layers + i}` (NextNLayer), not MiMo's mtp_layers
    mla: MLAArgs | None = None  # DeepSeek-V3's multi-latent attention (head_dim: its q/k head size)

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelArgs":
        arch = (config.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architectures={config.get('architectures')}: the embedded engine runs "
                             f"{SUPPORTED_ARCHITECTURES}; use --rollout-backend sglang for other models")
        try:  # MLA reads its own (YaRN) RoPE: mla.py
            rope_spec = None if arch in MLA_ARCHITECTURES else rope_math.rope_spec(config)
        except ValueError as e:
            raise ValueError(f"{e}; the embedded engine runs the same RoPE kinds") from None
        if arch in QK_NORM_ARCHITECTURES and config.get("attention_bias"):  # Qwen3
            raise ValueError(f"attention_bias=true in a {arch} config.json (q/k/v and o_proj biases): the "
                             "embedded engine serves Qwen3 as its checkpoints are, without biases; use "
                             "--rollout-backend sglang")
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        rope = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        glm = arch == "Glm4MoeForCausalLM"
        attention = mla_fields(config) if arch in MLA_ARCHITECTURES else {}
        return cls(**{**dict(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
            num_heads=heads, num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(rope),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch in ("Qwen2ForCausalLM", "MiMoForCausalLM") or bool(config.get("attention_bias", False)),
            mtp_layers=int(config.get("num_nextn_predict_layers", 0)) if arch in MTP_ARCHITECTURES else 0,
            rope_llama3=tuple(sorted(rope_spec.llama3.items())) if rope_spec and rope_spec.llama3 else None,
            qk_norm=arch in QK_NORM_ARCHITECTURES or (glm and bool(config.get("use_qk_norm", False))),
            rotary_dim=int(head_dim * partial_rotary_factor(config)) if glm else 0,
            nextn_mtp=arch in NEXTN_ARCHITECTURES,
            **moe_fields(config, arch),
        ), **attention})

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        if self.mla:
            return self.mla.cos_sin(positions, dtype)
        return rope_cos_sin(positions, self.rotary_dim or self.head_dim, self.rope_theta, dtype, self.rope_llama3)


def partial_rotary_factor(config: dict) -> float:
    """GLM-4.5's share of each head RoPE rotates, where SGLang's Glm4MoeDecoderLayer reads it (rope_scaling first;
    0.5 when the config has none)."""
    factor = (config.get("rope_scaling") or {}).get("partial_rotary_factor")
    if factor is None:
        factor = (config.get("rope_parameters") or {}).get("partial_rotary_factor", config.get("partial_rotary_factor"))
    return 0.5 if factor is None else float(factor)


@lru_cache(maxsize=None)
def inv_freq_on(device: torch.device, head_dim: int, theta: float,
                llama3: tuple[tuple[str, float], ...] | None = None) -> torch.Tensor:
    """RoPE's float32 inverse frequencies on `device`, computed once: a forward must not copy from the host (a
    pageable copy stalls the stream, and is refused while a CUDA graph is being captured)."""
    spec = rope_math.RopeSpec(theta, "llama3", dict(llama3)) if llama3 else rope_math.RopeSpec(theta, "default")
    return rope_math.inv_freq(spec, head_dim).to(device)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 llama3: tuple[tuple[str, float], ...] | None = None):
    """cos/sin `[B, T, head_dim]` for HF's rotate-half RoPE, computed in float32 like transformers;
    `llama3`: Llama-3.1's rescaled frequencies (common/rope.py, the trainer's math too)."""
    freqs = positions.float()[..., None] * inv_freq_on(positions.device, head_dim, theta, llama3)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
