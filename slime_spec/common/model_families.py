"""Model families (HF `model_type`) by trait, read by the trainer, the weight sync and the doctor alike."""

MOE_FAMILIES = ("qwen3_moe", "deepseek_v3", "glm4_moe", "glm4_moe_lite")  # mixture-of-experts MLPs (routed experts)
# Multi-latent attention. GLM-4.7-Flash (glm4_moe_lite) is DeepSeek-V3's architecture (MLA, sigmoid-routed experts
# with a shared one, dense-first layers, NextN MTP layers) with GLM's defaults: transformers builds its attention as
# DeepseekV3Attention and SGLang as DeepseekV2AttentionMLA, under the same tensor names.
MLA_FAMILIES = ("deepseek_v3", "glm4_moe_lite")
# NextN MTP layers stored as model.layers.{num_hidden_layers + i} (SGLang's *ForCausalLMNextN draft runners)
NEXTN_FAMILIES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
