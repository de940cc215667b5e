# GLM-4.5 (355B total, 32B active): 3 dense + 89 MoE layers, 160 routed experts, one native MTP layer.
N_DENSE_LAYERS=3
N_MOE_LAYERS=89

MODEL_ARGS=(
   --swiglu
   --num-layers $((N_DENSE_LAYERS + N_MOE_LAYERS))
   --hidden-size 5120
   --ffn-hidden-size 12288
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --qk-layernorm
   --position-embedding-type rope
   --rotary-percent 0.5
   --rotary-base 1000000
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --vocab-size 151552
   --untie-embeddings-and-output-weights
   --max-position-embeddings 131072

   # MoE
   --num-experts 160
   --moe-ffn-hidden-size 1536
   --moe-shared-expert-intermediate-size 1536
   --moe-router-topk 8
   --moe-router-topk-scaling-factor 2.5
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
