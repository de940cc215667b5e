# DeepSeek-V3 / R1 (671B total, 37B active): MLA, 3 dense + 58 MoE layers, 256 routed experts,
# one native MTP layer.
N_DENSE_LAYERS=3
N_MOE_LAYERS=58

MODEL_ARGS=(
   --swiglu
   --num-layers $((N_DENSE_LAYERS + N_MOE_LAYERS))
   --hidden-size 7168
   --ffn-hidden-size 18432
   --num-attention-heads 128
   --kv-channels 128
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --position-embedding-type rope
   --rotary-base 10000
   --rotary-scaling-factor 40
   --vocab-size 129280
   --untie-embeddings-and-output-weights
   --max-position-embeddings 163840

   # MLA
   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm

   # MoE
   --num-experts 256
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-router-topk-scaling-factor 2.5
   --moe-router-num-groups 8
   --moe-router-group-topk 4
   --moe-layer-freq "[0]*${N_DENSE_LAYERS}+[1]*${N_MOE_LAYERS}"
   --moe-router-pre-softmax
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-load-balancing-type seq_aux_loss
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
