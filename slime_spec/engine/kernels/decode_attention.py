"""RoPE, the KV-cache write and causal attention of a few query tokens per row, in one kernel over the static cache:
SGLang's `--attention-backend triton` for decode and chain verify (its decode_attention, reshaped for the embedded
engine's cache, with the rotary embedding and cache store fused in as SGLang fuses them into its rope kernel).

The SDPA path rotates q and k, scatters k and v into `[slots, max_seq, kv_heads, head_dim]`, gathers each row's keys
and values back out into a new tensor, builds a boolean mask and attends over the whole key bucket: half a dozen
kernels per layer. This kernel reads the fused q/k/v projection, writes the rotated key and the value by slot, and
reads the cache rows in place up to each query's own position (query at position p sees keys 0..p of its row). One
program serves one row's query heads of one KV head (GQA); a long context is split over several programs
(flash-decoding) and a second kernel merges their partial softmaxes. A verify's query tokens are laid out one of two
ways (`default_grid`): from batch 8 up, a row's tokens and heads are the rows of one block, so each key block is
read once for all of them (at batch 128, 4 tokens: 2.02-2.79x against a program per token); in smaller batches each
token gets its own programs, side by side, which keeps more of the GPU busy. A query's sums are the same bits in
every layout, so a verify computes what a decode of the same token would (bench/kernels_gpu.py, its grid table).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from slime_spec.engine.kernels import pdl_launch

# Decode, verify and short prefills. Every program of a row writes all of the row's new keys (then reads only what it
# wrote), so those writes grow as tokens squared: small up to here (a 32-token prefill ran 24 SDPA calls, the
# mask, the RoPE and the cache scatter and gather eagerly: about 30 of a 0.7B model's 40 ms first step at batch 1 on
# an H100). Longer prompts go to SDPA's flash kernels.
MAX_QUERY_TOKENS = 128
SPLIT_KEYS = 256   # keys per program before a context is split over several
MAX_PROGRAMS = 128  # split only while the grid is smaller than about one program per SM
MIN_HEAD_DIM = 32  # each half of a head (RoPE's rotate-half) is a dot of at least 16, Triton's smallest


GRIDS = ("token", "row_serial", "row_block")  # decode_attention's program layouts
# row_block: tokens x query heads per KV head held as one block, the matmuls' rows. Up to 32 the block's products
# are the per-token grid's bit for bit (measured on an H200, bench/kernels_gpu.py); at 64 rows Hopper's Triton takes
# another matmul instruction, and a verify's sums could differ from a decode's in their last bits.
MAX_BLOCK_ROWS = 32


MIN_BLOCK_BATCH = 8  # row_block: below this many rows a program per token keeps more of the GPU busy


def default_grid(rows: int, tokens: int, group: int) -> str:
    """A verify's tokens as one block per row where they fit and the batch fills the GPU without them (each key
    block read once for all of them: 2.02-2.79x at batch 128, 4 tokens on an H200; 0.81-0.98x at batch 1); a
    decode, a prefill or a small batch a program per token."""
    return "row_block" if rows >= MIN_BLOCK_BATCH and 1 < tokens and tokens * group <= MAX_BLOCK_ROWS else "token"


def supports(head_dim: int) -> bool:
    """Head sizes the kernel runs: a power of two in [MIN_HEAD_DIM, 256]."""
    return MIN_HEAD_DIM <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def num_splits(rows: int, kv_heads: int, num_keys: int) -> int:
    """Programs per (row, KV head): one per SPLIT_KEYS keys, while the grid stays under MAX_PROGRAMS. It depends on the
    rows, not the tokens per row, so a decode and a verify of one batch sum each query's keys in the same order."""
    return max(1, min(-(-num_keys // SPLIT_KEYS), MAX_PROGRAMS // max(1, rows * kv_heads)))


@lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def attention_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, out_ptr, part_ptr, stats_ptr,
                         T, num_keys, scale, stride_xb, stride_xt, stride_cb, stride_ct, stride_cs, stride_cp,
                         stride_ch, stride_sb, stride_pb, stride_pt, stride_ob, stride_ot, stride_oh,
                         HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                         BLOCK_S: tl.constexpr, SPLITS: tl.constexpr, CHUNK, PRECISION: tl.constexpr,
                         GRID: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # every operand comes from earlier kernels: wait for them first
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b, kvh = tl.program_id(0), tl.program_id(1)
        if GRID == 0:  # "token": one program per query token: axis 2 is split * T + token
            split, first = tl.program_id(2) // T, tl.program_id(2) % T
            last = first + 1
        else:  # "row_serial" (the row's tokens one after another), "row_block" (all of them as one block)
            split, first, last = tl.program_id(2), 0, T
        GROUP: tl.constexpr = HEADS // KV_HEADS
        HALF: tl.constexpr = D // 2
        slot = tl.load(slots_ptr + b * stride_sb)
        row = slot.to(tl.int64) * stride_cs + kvh * stride_ch
        h, d = tl.arange(0, HALF), tl.arange(0, D)
        # 1. this KV head's new keys (rotated) and values into the cache. Every program of the row and KV head (each
        # split, each token) writes them all (the same bytes), so each reads only what it wrote itself after the
        # barrier: a query token sees the keys of the tokens before it in this step.
        for j in range(T):
            x = qkv_ptr + b * stride_xb + j * stride_xt
            c = tl.load(cos_ptr + b * stride_cb + j * stride_ct + h).to(tl.float32)
            s = tl.load(sin_ptr + b * stride_cb + j * stride_ct + h).to(tl.float32)
            k1 = tl.load(x + (HEADS + kvh) * D + h).to(tl.float32)
            k2 = tl.load(x + (HEADS + kvh) * D + HALF + h).to(tl.float32)
            at = row + tl.load(pos_ptr + b * stride_pb + j * stride_pt).to(tl.int64) * stride_cp
            tl.store(k_ptr + at + h, (k1 * c - k2 * s).to(k_ptr.dtype.element_ty))
            tl.store(k_ptr + at + HALF + h, (k2 * c + k1 * s).to(k_ptr.dtype.element_ty))
            tl.store(v_ptr + at + d, tl.load(x + (HEADS + KV_HEADS + kvh) * D + d))
        tl.debug_barrier()
        # 2. its query tokens' heads of this KV head, rotated, over the keys up to each token's own position. The
        # rows of a block are (token, head) pairs, m -> token t0 + m // GROUP, head m % GROUP: one token's heads per
        # block ("token", "row_serial"; the heads padded to 16 rows), or every token of the row at once
        # ("row_block"), so each key block is read once for all of them. A row whose keys are all masked so far
        # keeps m = -inf, l = 0 and a zero sum, as a loop that never started: each query's sums are the same bits in
        # every layout.
        m = tl.arange(0, BLOCK_M)
        step = T if GRID == 2 else 1
        for t0 in range(first, last, step):
            t = t0 + m // GROUP
            m_ok = (m // GROUP < step) & (t < last)
            heads = kvh * GROUP + m % GROUP
            x = qkv_ptr + b * stride_xb + t[:, None] * stride_xt + heads[:, None] * D
            c = tl.load(cos_ptr + b * stride_cb + t[:, None] * stride_ct + h[None, :], mask=m_ok[:, None],
                        other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + b * stride_cb + t[:, None] * stride_ct + h[None, :], mask=m_ok[:, None],
                        other=0.0).to(tl.float32)
            q1 = tl.load(x + h[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
            q2 = tl.load(x + HALF + h[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
            r1 = (q1 * c - q2 * s).to(k_ptr.dtype.element_ty)
            r2 = (q2 * c + q1 * s).to(k_ptr.dtype.element_ty)
            pos = tl.load(pos_ptr + b * stride_pb + t * stride_pt, mask=m_ok, other=-1)
            ends = tl.minimum(tl.minimum(pos + 1, num_keys), (split + 1) * CHUNK)  # per row; 0 for padding rows
            end = tl.max(ends, 0)
            m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, D), tl.float32)
            for s0 in range(split * CHUNK, end, BLOCK_S):
                keys = s0 + tl.arange(0, BLOCK_S)
                k_ok = (keys < end)[:, None]
                offs = row + keys[:, None].to(tl.int64) * stride_cp
                ka = tl.load(k_ptr + offs + h[None, :], mask=k_ok, other=0.0)
                kb = tl.load(k_ptr + offs + HALF + h[None, :], mask=k_ok, other=0.0)
                scores = (tl.dot(r1, tl.trans(ka), input_precision=PRECISION)
                          + tl.dot(r2, tl.trans(kb), input_precision=PRECISION)) * scale
                scores = tl.where(keys[None, :] < ends[:, None], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: p = 0, not exp(-inf + inf)
                p = tl.exp(scores - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                v = tl.load(v_ptr + offs + d[None, :], mask=k_ok, other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new
            if SPLITS == 1:
                tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                         (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
            else:  # partial results [B*T, H, SPLITS, D] and (max, sum) [B*T, H, SPLITS, 2], merged by merge_kernel
                at = ((b * T + t) * HEADS + heads) * SPLITS + split
                tl.store(part_ptr + at[:, None] * D + d[None, :], acc, mask=m_ok[:, None])
                tl.store(stats_ptr + at * 2, m_i, mask=m_ok)
                tl.store(stats_ptr + at * 2 + 1, l_i, mask=m_ok)

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


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, num_keys: int, heads: int,
                     kv_heads: int, scale: float | None = None, splits: int | None = None,
                     grid: str | None = None) -> torch.Tensor:
    """Rotary embedding, the KV-cache write and causal attention in one pass.

    qkv [B, T, (heads + 2 kv_heads) * D]: the fused projection's output, q, k, v heads in that order, before RoPE;
    cos/sin [B, T, D] (HF's rotate-half layout, both halves equal); cache [slots, max_seq, kv_heads, D]; slots [B];
    positions [B, T]. Writes each token's rotated key and its value at (slots[b], positions[b, t]); query (b, t)
    attends to keys 0..positions[b, t] of its row, never past `num_keys`. Returns [B, T, heads, D] in qkv's dtype.
    grid (GRIDS; None: `default_grid`): "token", a program per query token; "row_block", a program per row with
    all its tokens' query heads as one block; "row_serial", a program per row taking its tokens in turn (the
    bench's comparison). Each query's sums are the same in all three."""
    b, t, width = qkv.shape
    d = cache_k.shape[-1]
    if (width != (heads + 2 * kv_heads) * d or heads % kv_heads or cache_k.shape[2] != kv_heads or not supports(d)
            or qkv.stride(-1) != 1 or cos.stride() != sin.stride() or cos.stride(-1) != 1
            or cache_k.stride() != cache_v.stride()):
        raise ValueError(f"decode_attention: qkv {tuple(qkv.shape)} ({heads} heads, {kv_heads} kv heads) over cache "
                         f"{tuple(cache_k.shape)}: needs heads a multiple of kv heads, a power-of-two head_dim in "
                         f"[{MIN_HEAD_DIM}, 256] and unit-stride rows")
    group = heads // kv_heads
    grid = grid or default_grid(b, t, group)
    if grid not in GRIDS or (grid == "row_block" and t * group > MAX_BLOCK_ROWS):
        raise ValueError(f"decode_attention: grid {grid!r} for {t} tokens of {group} query heads per KV head: one of "
                         f"{GRIDS}, row_block for at most {MAX_BLOCK_ROWS} tokens x heads")
    splits = splits or num_splits(b, kv_heads, num_keys)
    splits = 1 << (splits - 1).bit_length()  # merge_kernel loads the splits as one power-of-two block
    out = torch.empty(b, t, heads, d, dtype=qkv.dtype, device=qkv.device)
    part = stats = out
    if splits > 1:
        part = torch.empty(b * t * heads * splits * d, dtype=torch.float32, device=qkv.device)
        stats = torch.empty(b * t * heads * splits * 2, dtype=torch.float32, device=qkv.device)
    attention_kernel, merge_kernel = _kernels()
    attention_kernel[(b, kv_heads, splits * t if grid == "token" else splits)](
        qkv, cos, sin, cache_k, cache_v, slots, positions, out, part, stats, t, num_keys, scale or d ** -0.5,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1), cache_k.stride(0), cache_k.stride(1),
        cache_k.stride(2), slots.stride(0), positions.stride(0), positions.stride(1), out.stride(0), out.stride(1),
        out.stride(2), HEADS=heads, KV_HEADS=kv_heads, D=d,
        BLOCK_S=64, SPLITS=splits, CHUNK=-(-num_keys // splits),
        PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32", GRID=GRIDS.index(grid),
        BLOCK_M=max(16, 1 << ((t if grid == "row_block" else 1) * group - 1).bit_length()), num_warps=4,
        **pdl_launch(qkv))
    if splits > 1:
        merge_kernel[(b * t * heads,)](part, stats, out, t, heads, out.stride(0), out.stride(1), out.stride(2), D=d,
                                       SPLITS=splits)
    return out
