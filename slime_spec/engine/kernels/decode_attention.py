"""Causal attention of a few query tokens per row over the static KV cache, in place: SGLang's `--attention-backend
triton` for decode and chain verify (its decode_attention, reshaped for the embedded engine's cache).

The SDPA path first gathers each row's keys and values out of `[slots, max_seq, kv_heads, head_dim]` into a new
tensor, builds a boolean mask, and launches attention over the whole key bucket. This kernel reads the cache rows
by slot and stops at each query's own position (query at position p sees keys 0..p of its row), so a step reads
only the keys that exist. One program serves the query heads of one KV head (GQA) for one token; a long context is
split over several programs (flash-decoding) and a second kernel merges their partial softmaxes.
"""

from __future__ import annotations

from functools import lru_cache

import torch

MAX_QUERY_TOKENS = 16  # decode and verify; a prefill's many tokens per row go to SDPA's flash kernels
SPLIT_KEYS = 256   # keys per program before a context is split over several
MAX_PROGRAMS = 128  # split only while the grid is smaller than about one program per SM


def supports(head_dim: int) -> bool:
    """Head sizes the kernel runs: a power of two, at least 16 (Triton's smallest dot) and at most 256."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def num_splits(rows: int, kv_heads: int, num_keys: int) -> int:
    """Programs per (token, KV head): one per SPLIT_KEYS keys, while the grid stays under MAX_PROGRAMS. It depends on
    the rows, not the tokens per row, so a decode and a verify of one batch sum each query's keys in the same order."""
    return max(1, min(-(-num_keys // SPLIT_KEYS), MAX_PROGRAMS // max(1, rows * kv_heads)))


@lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def attention_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, out_ptr, part_ptr, stats_ptr, T, num_keys, scale,
                         stride_qb, stride_qt, stride_qh, stride_cs, stride_cp, stride_ch, stride_sb, stride_pb,
                         stride_pt, stride_ob, stride_ot, stride_oh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                         D: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr, CHUNK,
                         PRECISION: tl.constexpr):
        bt, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, t = bt // T, bt % T
        slot = tl.load(slots_ptr + b * stride_sb)
        pos = tl.load(pos_ptr + b * stride_pb + t * stride_pt)
        end = tl.minimum(tl.minimum(pos + 1, num_keys), (split + 1) * CHUNK)
        g, d = tl.arange(0, BLOCK_G), tl.arange(0, D)
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=(g < GROUP)[:, None], other=0.0)
        m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, D), tl.float32)
        row = slot.to(tl.int64) * stride_cs + kvh * stride_ch
        for s0 in range(split * CHUNK, end, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            s_ok = s < end
            offs = row + s[:, None].to(tl.int64) * stride_cp + d[None, :]
            k = tl.load(k_ptr + offs, mask=s_ok[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(s_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + offs, mask=s_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        g_ok = (g < GROUP)[:, None]
        if SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(out_ptr + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_ok)
        else:  # partial results [B*T, H, SPLITS, D] and (max, sum) [B*T, H, SPLITS, 2], merged by merge_kernel
            H = tl.num_programs(1) * GROUP
            at = (bt * H + heads) * SPLITS + split
            tl.store(part_ptr + at[:, None] * D + d[None, :], acc, mask=g_ok)
            tl.store(stats_ptr + at * 2, m_i, mask=g < GROUP)
            tl.store(stats_ptr + at * 2 + 1, l_i, mask=g < GROUP)

    @triton.jit
    def merge_kernel(part_ptr, stats_ptr, out_ptr, T, H, stride_ob, stride_ot, stride_oh,
                     D: tl.constexpr, SPLITS: tl.constexpr):
        bth = tl.program_id(0)
        bt, h = bth // H, bth % H
        b, t = bt // T, bt % T
        sp, d = tl.arange(0, SPLITS), tl.arange(0, D)
        m = tl.load(stats_ptr + (bth * SPLITS + sp) * 2)
        l_ = tl.load(stats_ptr + (bth * SPLITS + sp) * 2 + 1)
        w = tl.exp(m - tl.max(m, 0))  # an empty split has m = -inf: weight 0
        acc = tl.load(part_ptr + (bth * SPLITS + sp)[:, None] * D + d[None, :])
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l_ * w, 0)
        tl.store(out_ptr + b * stride_ob + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))

    return attention_kernel, merge_kernel


def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, num_keys: int, scale: float | None = None,
                     splits: int | None = None) -> torch.Tensor:
    """q [B, T, H, D] (its keys and values already written to the cache at `positions` [B, T]); cache
    [slots, max_seq, kv_heads, D]; slots [B]. Query (b, t) attends to keys 0..positions[b, t] of cache row
    slots[b], never past `num_keys`. Returns [B, T, H, D] in q's dtype."""
    b, t, h, d = q.shape
    kv_heads = cache_k.shape[2]
    if h % kv_heads or not supports(d) or q.stride(-1) != 1 or cache_k.stride() != cache_v.stride():
        raise ValueError(f"decode_attention: q {tuple(q.shape)} over cache {tuple(cache_k.shape)}: needs heads a "
                         f"multiple of kv heads, a power-of-two head_dim in [16, 256] and unit-stride rows")
    group = h // kv_heads
    splits = splits or num_splits(b, kv_heads, num_keys)
    splits = 1 << (splits - 1).bit_length()  # merge_kernel loads the splits as one power-of-two block
    chunk = -(-num_keys // splits)
    out = torch.empty_like(q)
    part = stats = out
    if splits > 1:
        part = torch.empty(b * t * h * splits * d, dtype=torch.float32, device=q.device)
        stats = torch.empty(b * t * h * splits * 2, dtype=torch.float32, device=q.device)
    attention_kernel, merge_kernel = _kernels()
    attention_kernel[(b * t, kv_heads, splits)](
        q, cache_k, cache_v, slots, positions, out, part, stats, t, num_keys, scale or d ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        slots.stride(0), positions.stride(0), positions.stride(1), out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, BLOCK_G=max(16, 1 << (group - 1).bit_length()), D=d, BLOCK_S=64, SPLITS=splits, CHUNK=chunk,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    if splits > 1:
        merge_kernel[(b * t * h,)](part, stats, out, t, h, out.stride(0), out.stride(1), out.stride(2), D=d,
                                   SPLITS=splits)
    return out
