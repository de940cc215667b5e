"""Model families (HF `model_type`) and their traits: the one list the trainer, the embedded engine, the weight sync,
the doctor and make-tiny-model all read. A new family is added here first."""

# Every family: its HF `model_type` -> the architecture its config.json names (what the engine and SGLang key on).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mimo": "MiMoForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "glm4_moe": "Glm4MoeForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM"}
FAMILIES = tuple(ARCHITECTURES)
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")  # a LayerNorm over each head's queries and keys
MOE_FAMILIES = ("qwen3_moe", "deepseek_v3", "glm4_moe", "glm4_moe_lite")  # mixture-of-experts MLPs (routed experts)
# MoE from `first_k_dense_replace` on, with shared experts and sigmoid routing over a correction bias
DENSE_FIRST_FAMILIES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
# Multi-latent attention. GLM-4.7-Flash (glm4_moe_lite) is DeepSeek-V3's architecture (MLA, sigmoid-routed experts
# with a shared one, dense-first layers, NextN MTP layers) with GLM's defaults: transformers builds its attention as
# DeepseekV3Attention and SGLang as DeepseekV2AttentionMLA, under the same tensor names.
MLA_FAMILIES = ("deepseek_v3", "glm4_moe_lite")
# NextN MTP layers stored as model.layers.{num_hidden_layers + i} (SGLang's *ForCausalLMNextN draft runners)
NEXTN_FAMILIES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
MTP_FAMILIES = ("mimo", *NEXTN_FAMILIES)  # MiMo's MTP layers are model.mtp_layers.{i}
FAMILY_OF_ARCHITECTURE = {arch: family for family, arch in ARCHITECTURES.items()}


def architectures(families: tuple[str, ...]) -> tuple[str, ...]:
    """The architecture names of `families`, in their order."""
    return tuple(ARCHITECTURES[f] for f in families)
