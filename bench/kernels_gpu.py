"""The engine's Triton kernels against what they replace, on one GPU: correctness, then time inside CUDA graphs.

    python bench/kernels_gpu.py            # the 0.7B shape of bench/engine_gpu.py (hidden 1536, 24 layers)
    python bench/kernels_gpu.py --sweep    # also gemv tile configurations at 1, 2, 4 and 8 rows

gemv: each decoder matmul of the shape at 1 to 8 rows (a decode, a verify of k + 1 tokens), as the 24 layers run it
(24 distinct weight matrices in one graph, so weights stream from HBM as in a step, not from L2), cuBLAS (F.linear)
against the gemv kernel;
GB/s is weight bytes over time. decode_attention: a decode (1 token) and a k=3 verify (4 tokens) over the static
cache, SDPA's path (rotate q and k, write the cache, gather the rows' keys, mask, cuDNN as in a captured graph)
against the fused kernel, for 24 layers. rms_norm: a layer's residual add and RMSNorm, eager (HF's module: upcast,
normalise, downcast, weight) against the kernel, 48 per step as in 24 layers. Then the attention kernel's two grids
for a verify (several tokens per row): one program per row for all its tokens in turn, against one per token (the
engine's).
Times are the median of graph replays (CUDA events); every kernel output is first checked against float32.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from slime_spec.engine.kernels.decode_attention import GRIDS, MAX_BLOCK_ROWS, decode_attention
from slime_spec.engine.kernels.gemv import GemvConfig, gemv, gemv_config
from slime_spec.engine.kernels.rms_norm import rms_norm
from slime_spec.engine.model_executor.model import RMSNorm, apply_rope, causal_mask, rope_cos_sin

SHAPE = dict(hidden=1536, layers=24, heads=12, kv_heads=2, head_dim=128, ffn=4096, vocab=32000)


def graph_ms(fn, replays: int = 50) -> float:
    """Median ms of one replay of `fn` captured as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def matmul_rows(s: dict, sweep: bool) -> list[str]:
    shapes = {"qkv": ((s["heads"] + 2 * s["kv_heads"]) * s["head_dim"], s["hidden"]),
              "o_proj": (s["hidden"], s["heads"] * s["head_dim"]), "gate_up": (2 * s["ffn"], s["hidden"]),
              "down": (s["hidden"], s["ffn"]), "lm_head": (s["vocab"], s["hidden"])}
    out = []
    for (name, (n, k)), rows in itertools.product(shapes.items(), (1, 2, 4, 6, 8)):
        copies = 1 if name == "lm_head" else s["layers"]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.double(), ws[0].double()).float()
        err = rel_err(gemv(x, ws[0]), ref)
        assert err < 1e-2, f"gemv {name} rows {rows}: relative error {err}"
        nbytes = copies * n * k * 2
        cublas = graph_ms(lambda: [F.linear(x, w) for w in ws])
        best = graph_ms(lambda: [gemv(x, w) for w in ws])
        chosen = gemv_config(rows, n, k)
        line = (f"| {name} {n}x{k} | {rows} | {cublas * 1e3 / copies:.1f} | {nbytes / cublas / 1e6:,.0f} | "
                f"{best * 1e3 / copies:.1f} | {nbytes / best / 1e6:,.0f} | {cublas / best:.2f}x | {err:.1e} |")
        if sweep and rows in (1, 2, 4, 8) and n <= 4096:  # the shapes the kernel may serve
            trials = {}
            for bn, bk, warps in itertools.product((1, 2, 4, 8), (1024, 2048), (4, 8)):
                c = GemvConfig(bn, bk, warps)
                trials[c] = graph_ms(lambda: [gemv(x, w, config=c) for w in ws], replays=20)
            top = sorted(trials.items(), key=lambda kv: kv[1])[:3] if trials else []
            line += " " + ", ".join(f"{c.block_n}/{c.block_k}/{c.num_warps}: {nbytes / t / 1e6:,.0f}" for c, t in top)
            line += f" (chosen {chosen.block_n}/{chosen.block_k}/{chosen.num_warps}) |"
        elif sweep:
            line += " - |"
        out.append(line)
        ws = None  # free this shape's weights before the next is allocated
    return out


def attention_case(s: dict, batch: int, tokens: int, keys: int):
    """24 layers' caches, the fused qkv input, slots, positions (each row's own length, ending below `keys`) and
    their RoPE cos/sin, for one (batch, tokens per row, keys) case."""
    kvh, d = s["kv_heads"], s["head_dim"]
    max_seq = keys + 8
    caches = [(torch.randn(batch + 1, max_seq, kvh, d, device="cuda", dtype=torch.bfloat16),
               torch.randn(batch + 1, max_seq, kvh, d, device="cuda", dtype=torch.bfloat16))
              for _ in range(s["layers"])]
    qkv = torch.randn(batch, tokens, (s["heads"] + 2 * kvh) * d, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(batch, device="cuda")
    lengths = torch.randint(keys // 2, keys - tokens + 1, (batch,), device="cuda")
    positions = lengths[:, None] + torch.arange(tokens, device="cuda")[None]
    cos, sin = rope_cos_sin(positions, d, 10000.0, torch.bfloat16)
    return caches, qkv, slots, positions, cos, sin


def attention_rows(s: dict) -> list[str]:
    """RoPE + cache write + attention per layer: the SDPA path (rotate q and k, scatter k and v into the cache, gather
    the rows' keys back, mask, cuDNN) against the fused kernel."""
    h, kvh, d = s["heads"], s["kv_heads"], s["head_dim"]
    out = []
    for batch, tokens, keys in itertools.product((1, 8, 32), (1, 4), (256, 2048)):
        caches, qkv, slots, positions, cos, sin = attention_case(s, batch, tokens, keys)
        mask = causal_mask(positions, keys)

        def sdpa(ck, cv, dtype=torch.bfloat16):
            q, k, v = qkv.to(dtype).split([h * d, kvh * d, kvh * d], dim=-1)
            q = apply_rope(q.reshape(batch, tokens, h, d), cos.to(dtype), sin.to(dtype))
            ck[slots[:, None], positions] = apply_rope(k.reshape(batch, tokens, kvh, d), cos.to(dtype), sin.to(dtype))
            cv[slots[:, None], positions] = v.reshape(batch, tokens, kvh, d)
            keys_, values = ck[slots, :keys].transpose(1, 2), cv[slots, :keys].transpose(1, 2)
            return F.scaled_dot_product_attention(q.transpose(1, 2), keys_, values, attn_mask=mask,
                                                  enable_gqa=True).transpose(1, 2)

        ck, cv = caches[0]
        ref = sdpa(ck.double(), cv.double(), torch.float64).float()
        err = rel_err(decode_attention(qkv, cos, sin, ck, cv, slots, positions, keys, h, kvh), ref)
        assert err < 1e-2, f"decode_attention batch {batch} tokens {tokens} keys {keys}: relative error {err}"
        t_sdpa = graph_ms(lambda: [sdpa(ck, cv) for ck, cv in caches])
        t_kernel = graph_ms(lambda: [decode_attention(qkv, cos, sin, ck, cv, slots, positions, keys, h, kvh)
                                     for ck, cv in caches])
        n = s["layers"]
        out.append(f"| {batch} | {tokens} | {keys} | {t_sdpa * 1e3 / n:.1f} | {t_kernel * 1e3 / n:.1f} | "
                   f"{t_sdpa / t_kernel:.2f}x | {err:.1e} |")
    return out


def attention_grid_rows(s: dict) -> list[str]:
    """The attention kernel for a verify: one program per row taking its tokens in turn, one per token, and one per
    row holding all its tokens' query heads as one block, side by side, per layer over the layers' caches (the same
    bits asserted)."""
    h, kvh = s["heads"], s["kv_heads"]
    out = []
    for batch, tokens, keys in itertools.product((1, 8, 32, 64, 128), (2, 4, 6), (256, 2048)):
        caches, qkv, slots, positions, cos, sin = attention_case(s, batch, tokens, keys)
        ck, cv = caches[0]
        grids = [g for g in GRIDS if g != "row_block" or tokens * (h // kvh) <= MAX_BLOCK_ROWS]
        outs = [decode_attention(qkv, cos, sin, ck, cv, slots, positions, keys, h, kvh, grid=grid) for grid in grids]
        assert all(torch.equal(outs[0], o) for o in outs), f"batch {batch} tokens {tokens} keys {keys}: grids differ"
        times = {grid: graph_ms(lambda grid=grid: [decode_attention(qkv, cos, sin, ck, cv, slots, positions, keys, h,
                                                                    kvh, grid=grid) for ck, cv in caches])
                 for grid in grids}
        n = s["layers"]
        block = f"{times['row_block'] * 1e3 / n:.1f} | {times['token'] / times['row_block']:.2f}x" \
            if "row_block" in times else "- | -"
        out.append(f"| {batch} | {tokens} | {keys} | {times['row_serial'] * 1e3 / n:.1f} | "
                   f"{times['token'] * 1e3 / n:.1f} | {block} |")
    return out


def norm_rows(s: dict) -> list[str]:
    """A residual add and RMSNorm, 2 per layer: eager torch (HF's module) against the kernel."""
    out = []
    n = 2 * s["layers"]
    for rows in (1, 4, 32):
        norms = [RMSNorm(s["hidden"], 1e-6).to("cuda", torch.bfloat16) for _ in range(n)]
        x, delta = (torch.randn(rows, s["hidden"], device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = norms[0](x + delta)
        err = rel_err(rms_norm(x, norms[0].weight, 1e-6, delta)[0], ref.float())
        assert err < 1e-2, f"rms_norm rows {rows}: relative error {err}"
        eager = graph_ms(lambda: [norm(x + delta) for norm in norms])
        fused = graph_ms(lambda: [rms_norm(x, norm.weight, 1e-6, delta) for norm in norms])
        out.append(f"| {rows} | {eager * 1e3 / n:.1f} | {fused * 1e3 / n:.1f} | {eager / fused:.2f}x | {err:.1e} |")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep", action="store_true", help="time gemv tile configurations at 1, 2, 4 and 8 rows")
    p.add_argument("--attention-grids", action="store_true", help="only the attention kernel's grids for a verify")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("\n| batch | tokens per row | keys | a program per row, tokens in turn, us per layer | a program per token "
          "us per layer | a program per row, tokens as one block, us per layer | per token / per row block |")
    print("|---|---|---|---|---|---|---|")
    for line in attention_grid_rows(SHAPE):
        print(line, flush=True)
    if a.attention_grids:
        return
    print("\n| matmul (N x K) | rows | cuBLAS us | cuBLAS GB/s | gemv us | gemv GB/s | cuBLAS / gemv | gemv rel. err |"
          + (" sweep: best block_n/block_k/warps: GB/s |" if a.sweep else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if a.sweep else ""))
    for line in matmul_rows(SHAPE, a.sweep):
        print(line, flush=True)
    print("\n| rows | residual add + RMSNorm, eager us | fused kernel us | eager / kernel | rel. err |")
    print("|---|---|---|---|---|")
    for line in norm_rows(SHAPE):
        print(line, flush=True)
    print("\n| batch | tokens per row | keys | RoPE + cache write + SDPA us per layer | fused kernel us per layer "
          "| SDPA path / kernel | rel. err |")
    print("|---|---|---|---|---|---|---|")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH]):
        for line in attention_rows(SHAPE):
            print(line, flush=True)


if __name__ == "__main__":
    main()
