#!/bin/bash
# GRPO on MiMo-7B-RL with its native MTP layer as the speculative draft (EAGLE 3/1/4), and the MTP
# layer trained online (--enable-mtp-training) so the draft keeps up with the policy. One 8-GPU node,
# colocated: trainer and engines share the GPUs.
#
#   bash scripts/run-mimo-7B-rl-mtp.sh                      # check, start Ray if needed, submit
#   DOCTOR_ONLY=1 bash scripts/run-mimo-7B-rl-mtp.sh        # only check the configuration
#   DEBUG_ROLLOUT_ONLY=1 bash scripts/run-mimo-7B-rl-mtp.sh # engines only, no trainer
# EXTRA_ARGS="--num-rollout 2 ..." appends flags (last one wins). SMALL_MACHINE=1 HF_CHECKPOINT=... PROMPT_DATA=...
# runs it on one machine without GPUs; scripts/common.sh lists every environment override.
set -eo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/mimo-7B-rl.sh"
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
   --hf-checkpoint "${BASE_DIR}/MiMo-7B-RL"
   --load "${BASE_DIR}/MiMo-7B-RL_slime_spec"
   --save "${BASE_DIR}/MiMo-7B-RL_slime_spec"
   --save-interval 100
)

ROLLOUT_ARGS=(
   --prompt-data "${BASE_DIR}/dapo-math-17k/dapo-math-17k.jsonl"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 0.8
   --global-batch-size 256
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime "${BASE_DIR}/aime-2024/aime-2024.jsonl"
   --n-samples-per-eval-prompt 8
   --eval-max-response-len 8192
   --eval-top-p 0.7
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
   WANDB_ARGS=(--use-wandb --wandb-project slime-spec --wandb-group mimo-7B-rl-mtp --wandb-key "${WANDB_API_KEY}")
fi

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 1
   --sglang-mem-fraction-static 0.7

   # native MTP as the EAGLE draft: no draft model path
   --sglang-speculative-algorithm EAGLE
   --sglang-speculative-num-steps 3
   --sglang-speculative-eagle-topk 1
   --sglang-speculative-num-draft-tokens 4

   # flashinfer has shown CUDA-graph padding failures in the draft stage
   --sglang-attention-backend fa3
   # capture every batch size up to 32, then a step list up to the max running requests
   --sglang-cuda-graph-bs-decode $(seq 1 32) $(seq 40 8 64) $(seq 80 16 128)
   --sglang-max-running-requests 128
   # --colocate: engines release their GPU memory while the trainer runs. Without the memory saver
   # SGLang's release does nothing; the CPU backup keeps the draft's weights across it.
   --sglang-enable-memory-saver
   --sglang-enable-draft-weights-cpu-backup
)

SPEC_ARGS=(
   --mtp-num-layers 1
   --enable-mtp-training
   --mtp-loss-scaling-factor 0.2
)

DEBUG_ARGS=()
if [ "${DEBUG_ROLLOUT_ONLY:-0}" = 1 ]; then DEBUG_ARGS=(--debug-rollout-only); fi

slime_spec_launch \
   "${CLUSTER_ARGS[@]}" "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" \
   "${PERF_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${WANDB_ARGS[@]}" "${SGLANG_ARGS[@]}" \
   "${SPEC_ARGS[@]}" "${DEBUG_ARGS[@]}"
