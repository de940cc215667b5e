"""Model families (HF `model_type`) by trait, read by the trainer, the weight sync and the doctor alike."""

MOE_FAMILIES = ("qwen3_moe", "deepseek_v3", "glm4_moe")  # mixture-of-experts MLPs (routed experts)
