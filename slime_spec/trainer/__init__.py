"""Trainer: the Megatron policy (+ MTP layers, or an online EAGLE3 draft) and its GRPO / SFT training, one
process per GPU.

- cpu_compat.py: megatron-core's CUDA-only calls redirected to the CPU when there is no CUDA.
- parallel.py: torch.distributed + Megatron TP/DP groups (gloo on CPU, nccl on CUDA).
- model.py: GPTModel from an HF config, HF weights loaded, the trunk's logits, each MTP layer's hidden states
  (and, for an EAGLE3 draft, the detached outputs of its aux layers and the embeddings).
- model_config.py: megatron-core's TransformerConfig from an HF config; which families build, and how.
- sdpa_attention.py: the core attention of multi-latent attention (DeepSeek-V3) without TransformerEngine.
- eagle3_ttt.py: EAGLE3's training-time-test loss over several unrolled draft steps (pure).
- eagle3_online.py: `OnlineDraft`, the draft trained next to the policy (--enable-draft-training).
- losses.py: GRPO advantages, PPO clip, KL estimators, entropy, SFT and MTP losses (pure).
- batch.py: samples -> padded tensors and masks; optimizer steps / micro-batches per rank, by samples or
  packed by tokens and balanced by tokens over data-parallel ranks (pure).
- packing.py: what the model reads per micro-batch: padded rows or one packed row (block-diagonal mask).
- mtp_loss.py: the MTP loss with the frozen output layer fused into a chunked cross-entropy, trained
  targets only (no [tokens, vocab] logits kept).
- timing.py: the per-part split of a train step, for the benchmark.
- precision.py: float32 master weights for a --bf16 model.
- checkpoint.py: --save / --load format.
- trainer.py: `Trainer`, one process's model + optimizer + steps.
- actor.py / group.py: `TrainActor` (Ray) and `TrainGroup` (all actors, weight sync into the engines).
RoPE (common/rope.py) and the EAGLE3 draft head (common/eagle3_draft.py) are shared with the embedded engine.
"""
