"""Core attention without TransformerEngine: for multi-latent attention, and for every layer under context
parallelism.

megatron-core 0.16.1 builds MLA's core attention with `k_channels` / `v_channels` (MLA's keys are
qk_nope + qk_rope wide, its values v_head_dim), which only TransformerEngine's DotProductAttention takes: the local
DotProductAttention has no such arguments and sizes its output as kv_channels x heads. `SDPACoreAttention` stands in
for TE's fused attention there: megatron's core-attention interface (query / key / value [s, b, heads, dim], the
boolean mask with True = masked, output [s, b, heads * v_dim]) over torch's scaled_dot_product_attention, which
takes a value head dim apart from the key's. It holds no parameters; everything around it (projections, norms,
YaRN RoPE, softmax scale) is megatron's MLASelfAttention.

Under context parallelism (megatron-core's local DotProductAttention refuses it) each rank's queries attend to the
keys and values of the whole row, gathered from every context-parallel rank (context_parallel.py); the mask holds
this rank's query rows against every column.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    """softmax(q k^T * softmax_scale, masked) v over torch's scaled_dot_product_attention, per head."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection=None):
        super().__init__(config=config)
        self.context_parallel = config.context_parallel_size > 1
        self.attn_mask_type = attn_mask_type
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention takes a boolean attention mask only (no packed_seq_params / "
                             "attention_bias): packed rows reach it as one row with a block-diagonal mask")
        if self.context_parallel:
            from slime_spec.trainer.context_parallel import gather_keys_values

            if attention_mask is None:
                raise ValueError("context parallel attention needs the mask of this rank's query rows "
                                 "(context_parallel.ContextSplit.local_rows)")
            key, value = gather_keys_values(key), gather_keys_values(value)
        heads = query.shape[2]
        if key.shape[2] != heads:  # grouped keys and values: each group serves heads / groups query heads
            key = key.repeat_interleave(heads // key.shape[2], dim=2)
            value = value.repeat_interleave(heads // value.shape[2], dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        causal = attention_mask is None and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        mask = None if attention_mask is None else ~attention_mask  # megatron masks True, torch keeps True
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p:
            from megatron.core import tensor_parallel
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                     is_causal=causal, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * value.shape[-1])
