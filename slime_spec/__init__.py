"""slime-spec: speculative rollout for RL training (Megatron + SGLang + Ray, slime style)."""

__version__ = "0.1.0"
