#!/bin/bash
# GRPO on Llama-3.1-8B-Instruct (llama3 RoPE scaling) with the external sglang-EAGLE3-LLaMA3.1-Instruct-8B
# draft, trained online on the policy's own rollouts (--enable-draft-training: EAGLE3's training-time test
# over --draft-ttt-steps steps, its own AdamW at --draft-lr; docs/en/speculative.md). Drop SPEC_ARGS to keep
# the draft frozen: weight sync then updates the target only (selector "target").
# One 8-GPU node, colocated. The SGLANG_ARGS are those of the EAGLE3 example: the draft is float16 and
# supports 2048 positions, so dtype and context length must be set for the pair to agree.
# Tiny stand-in on CPU (SMALL_MACHINE=1 HF_CHECKPOINT=<tiny llama> DRAFT_CHECKPOINT=<its EAGLE3 draft>, made by
# `slime-spec make-tiny-model --arch llama --num-layers 4 --llama31-rope --out T --eagle3-draft D`): the
# embedded engine serves the same 5 / 8 / 32 EAGLE3 tree (eagle-topk > 1 runs eagerly there; a chain,
# EXTRA_ARGS="--sglang-speculative-eagle-topk 1 --sglang-speculative-num-draft-tokens 6", is faster on CPU).
#
#   bash scripts/run-eagle3-llama3.1-8B.sh                      # check, start Ray if needed, submit
#   DOCTOR_ONLY=1 bash scripts/run-eagle3-llama3.1-8B.sh        # only check the configuration
#   DEBUG_ROLLOUT_ONLY=1 bash scripts/run-eagle3-llama3.1-8B.sh # engines only, no trainer
# EXTRA_ARGS="--num-rollout 2 ..." appends flags (last one wins). SMALL_MACHINE=1 HF_CHECKPOINT=... PROMPT_DATA=...
# runs it on one machine without GPUs; scripts/common.sh lists every environment override.
set -eo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/llama3.1-8B-Instruct.sh"
if [ -n "${HF_CHECKPOINT:-}" ]; then MODEL_ARGS=(); fi  # its shape comes from its config.json
source "${SCRIPT_DIR}/common.sh"
BASE_DIR="${BASE_DIR:-/root}"
NUM_GPUS_PER_NODE="${NUM_GPUS_PER_NODE:-8}"

CLUSTER_ARGS=(
   --actor-num-nodes 1
   --actor-num-gpus-per-node "${NUM_GPUS_PER_NODE}"
   --rollout-num-gpus "${NUM_GPUS_PER_NODE}"
   --colocate
   --rollout-backend sglang
)

CKPT_ARGS=(
   --hf-checkpoint "${BASE_DIR}/Llama-3.1-8B-Instruct"
   --load "${BASE_DIR}/Llama-3.1-8B-Instruct_slime_spec"
   --save "${BASE_DIR}/Llama-3.1-8B-Instruct_slime_spec"
   --save-interval 100
)

# 256 prompt + 1792 response tokens fit the draft's 2048 positions.
ROLLOUT_ARGS=(
   --prompt-data "${BASE_DIR}/gsm8k/gsm8k-train.jsonl"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type math
   --num-rollout 3000
   --rollout-batch-size 64
   --n-samples-per-prompt 8
   --rollout-max-prompt-len 256
   --rollout-max-response-len 1792
   --rollout-temperature 0.8
   --global-batch-size 512
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

WANDB_ARGS=()
if [ -n "${WANDB_API_KEY:-}" ]; then
   WANDB_ARGS=(--use-wandb --wandb-project slime-spec --wandb-group eagle3-llama3.1-8B --wandb-key "${WANDB_API_KEY}")
fi

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 1
   --sglang-mem-fraction-static 0.8

   --sglang-speculative-algorithm EAGLE3
   --sglang-speculative-draft-model-path "${BASE_DIR}/sglang-EAGLE3-LLaMA3.1-Instruct-8B"
   --sglang-speculative-num-steps 5
   --sglang-speculative-eagle-topk 8
   --sglang-speculative-num-draft-tokens 32

   --sglang-max-running-requests 48
   --sglang-dtype float16
   --sglang-context-length 2048
   --sglang-attention-backend fa3
   # every batch size up to the 48 running requests has its own CUDA graph (no padding in the draft stage)
   --sglang-cuda-graph-bs-decode $(seq 1 32) 40 48
   # --colocate: engines release their GPU memory while the trainer runs. Without the memory saver
   # SGLang's release does nothing; the CPU backup keeps the draft's weights across it.
   --sglang-enable-memory-saver
   --sglang-enable-draft-weights-cpu-backup
)

# The EAGLE3 draft is an external model (no MTP layers): it is trained next to the policy instead.
SPEC_ARGS=(
   --enable-draft-training
   --draft-lr 5e-5
   --draft-ttt-steps 7
)

DEBUG_ARGS=()
if [ "${DEBUG_ROLLOUT_ONLY:-0}" = 1 ]; then DEBUG_ARGS=(--debug-rollout-only); fi

slime_spec_launch \
   "${CLUSTER_ARGS[@]}" "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${PERF_ARGS[@]}" \
   "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${WANDB_ARGS[@]}" "${SGLANG_ARGS[@]}" "${SPEC_ARGS[@]}" \
   "${DEBUG_ARGS[@]}"
