#!/bin/bash
# GRPO on DeepSeek-V3 with its native MTP layer as the speculative draft (EAGLE 3/1/4) and the MTP
# layer trained online. 8 nodes x 8 GPUs, colocated; one SGLang engine per node (TP 8).
# Memory per engine GPU: the FP8 checkpoint is ~690 GB (671B + 14B MTP parameters at 1 byte, plus
# scales), ~86 GB per GPU at TP 8, and --sglang-mem-fraction-static 0.7 gives SGLang 0.7 x the GPU for
# weights and KV cache. H200 (141 GB): 0.7 x 141 = ~99 GB, ~13 GB left for KV cache: fits. H20 (96 GB):
# 0.7 x 96 = ~67 GB < 86 GB: does NOT fit (0.95 would leave ~5 GB of KV cache). On H20 one engine must
# span 2 nodes (TP 16 or TP 8 x PP 2, ~43 GB per GPU), which needs multi-node engines (see below: not
# available yet).
#
# Multi-node: start Ray on every worker node first (`ray start --address ${MASTER_ADDR}:6379 --num-gpus 8`,
# through your cluster's launcher) and set RAY_ADDRESS to the head's GCS address; without RAY_ADDRESS
# this script starts a head of its own, on one node. Engines spanning several nodes (--rollout-num-gpus-per-engine above one node's GPUs)
# are not available yet: slime-spec does not pass SGLang's --nnodes/--node-rank/--dist-init-addr.
# The trainer builds this MoE model (megatron-core's multi-latent attention, MoE and MTP block) as laid out below:
# TP 8 x EP 16 with whole experts (--expert-tensor-parallel-size 1) over 4 pipeline stages (megatron-core's 1F1B
# schedule; the last holds 13 layers and the MTP layer). Run the speculative rollout alone with DEBUG_ROLLOUT_ONLY=1
# (engines, metrics, no trainer). SMALL_MACHINE=1 with a tiny stand-in (`slime-spec make-tiny-model --arch
# deepseek_v3`) trains it end to end on CPU: policy and MTP layer, speculative rollout, weight sync.
#
#   DOCTOR_ONLY=1 bash scripts/run-deepseek-v3-mtp.sh        # only check the configuration
#   DEBUG_ROLLOUT_ONLY=1 bash scripts/run-deepseek-v3-mtp.sh # engines only, no trainer
# EXTRA_ARGS="--num-rollout 2 ..." appends flags (last one wins). SMALL_MACHINE=1 HF_CHECKPOINT=... PROMPT_DATA=...
# runs it on one machine without GPUs; scripts/common.sh lists every environment override.
set -eo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/deepseek-v3.sh"
if [ -n "${HF_CHECKPOINT:-}" ]; then MODEL_ARGS=(); fi  # its shape comes from its config.json
source "${SCRIPT_DIR}/common.sh"
BASE_DIR="${BASE_DIR:-/root}"
NUM_NODES="${NUM_NODES:-8}"
NUM_GPUS_PER_NODE="${NUM_GPUS_PER_NODE:-8}"

CLUSTER_ARGS=(
   --actor-num-nodes "${NUM_NODES}"
   --actor-num-gpus-per-node "${NUM_GPUS_PER_NODE}"
   --rollout-num-gpus $((NUM_NODES * NUM_GPUS_PER_NODE))
   --colocate
   --rollout-backend sglang
)

CKPT_ARGS=(
   --hf-checkpoint "${BASE_DIR}/DeepSeek-V3"
   --load "${BASE_DIR}/DeepSeek-V3_slime_spec"
   --save "${BASE_DIR}/DeepSeek-V3_slime_spec"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data "${BASE_DIR}/dapo-math-17k/dapo-math-17k.jsonl"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000
   --rollout-batch-size 128
   --n-samples-per-prompt 8
   --rollout-max-response-len 32768
   --rollout-temperature 0.8
   --global-batch-size 1024
   --sglang-server-concurrency 256
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime "${BASE_DIR}/aime-2024/aime-2024.jsonl"
   --n-samples-per-eval-prompt 8
   --eval-max-response-len 32768
   --eval-top-p 0.7
)

PERF_ARGS=(
   --tensor-model-parallel-size 8
   --sequence-parallel
   --pipeline-model-parallel-size 4
   --context-parallel-size 1
   --expert-model-parallel-size 16
   --expert-tensor-parallel-size 1
   --decoder-last-pipeline-num-layers 13
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 16384
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
   --optimizer-cpu-offload
   --overlap-cpu-optimizer-d2h-h2d
   --use-precision-aware-optimizer
)

WANDB_ARGS=()
if [ -n "${WANDB_API_KEY:-}" ]; then
   WANDB_ARGS=(--use-wandb --wandb-project slime-spec --wandb-group deepseek-v3-mtp --wandb-key "${WANDB_API_KEY}")
fi

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 8
   --sglang-mem-fraction-static 0.7

   # native MTP as the EAGLE draft: no draft model path
   --sglang-speculative-algorithm EAGLE
   --sglang-speculative-num-steps 3
   --sglang-speculative-eagle-topk 1
   --sglang-speculative-num-draft-tokens 4

   # flashinfer has shown CUDA-graph padding failures in the draft stage
   --sglang-attention-backend fa3
   # capture every batch size up to 32, then a step list up to the max running requests
   --sglang-cuda-graph-bs-decode $(seq 1 32) $(seq 40 8 64) $(seq 80 16 256)
   --sglang-max-running-requests 256
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
