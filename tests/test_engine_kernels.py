"""The engine's Triton kernels (engine/kernels): their math against torch's on CPU in Triton's interpreter, the flags
that pick them, and on CUDA the engine's greedy output with and without them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slime_spec.engine.kernels.decode_attention import default_grid, num_splits, supports
from slime_spec.engine.kernels.gemv import serves
from slime_spec.engine.kernels.ops import Kernels


def test_gemv_equals_linear_for_every_row_count_with_and_without_bias(run_interpreted):
    out = run_interpreted("""
        import torch, torch.nn.functional as F
        from slime_spec.engine.kernels.gemv import gemv, GemvConfig
        torch.manual_seed(0)
        for rows in (1, 2, 3, 4, 6, 8):
            for n, k in ((40, 96), (33, 200)):   # widths that are not multiples of the tiles
                x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
                for bias in (None, b):
                    got = gemv(x, w, bias, config=GemvConfig(8, 64, 4))
                    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                    assert got.shape == (rows, n), got.shape
                    assert torch.allclose(got.double(), ref, atol=1e-4), (rows, n, k, (got - ref).abs().max())
        x3 = torch.randn(2, 1, 96)   # leading dimensions are kept
        assert gemv(x3, torch.randn(40, 96)).shape == (2, 1, 40)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_gemv_refuses_more_rows_than_it_holds():
    from slime_spec.engine.kernels.gemv import gemv
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv(torch.randn(9, 8), torch.randn(4, 8))


def test_decode_attention_writes_rotated_keys_and_equals_masked_sdpa_over_the_cache_rows(run_interpreted):
    out = run_interpreted("""
        import torch, torch.nn.functional as F
        from slime_spec.engine.kernels.decode_attention import GRIDS, decode_attention
        from slime_spec.engine.model_executor.model import apply_rope, rope_cos_sin
        torch.manual_seed(0)
        B, T, H, KVH, D, max_seq = 3, 2, 6, 2, 32, 700
        qkv = torch.randn(B, T, (H + 2 * KVH) * D)
        # slots and positions as strided views of one [B, 3] input tensor, as the engine's decode step passes them
        inputs = torch.tensor([[5, 6, 4], [600, 601, 0], [0, 1, 2]])
        slots, pos = inputs[:, 2], inputs[:, :2]
        cos, sin = rope_cos_sin(pos, D, 10000.0, torch.float32)
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        q = apply_rope(q.reshape(B, T, H, D), cos, sin)
        k = apply_rope(k.reshape(B, T, KVH, D), cos, sin)
        for num_keys, splits, grid in ((602, None, None), (602, None, "token"), (602, 3, "token"),
                                       (602, 3, "row_block"), (602, 1, "row_serial"), (700, 8, "row_block")):
            ck, cv = torch.randn(5, max_seq, KVH, D), torch.randn(5, max_seq, KVH, D)
            ref_k, ref_v = ck.clone(), cv.clone()
            ref_k[slots[:, None], pos] = k
            ref_v[slots[:, None], pos] = v.reshape(B, T, KVH, D)
            keys = ref_k[slots].repeat_interleave(H // KVH, 2).transpose(1, 2)
            vals = ref_v[slots].repeat_interleave(H // KVH, 2).transpose(1, 2)
            causal = (torch.arange(max_seq)[None, None, :] <= pos[:, :, None])[:, None]
            mask = causal & (torch.arange(max_seq) < num_keys)
            ref = F.scaled_dot_product_attention(q.transpose(1, 2).double(), keys.double(), vals.double(),
                                                 attn_mask=mask).transpose(1, 2)
            got = decode_attention(qkv, cos, sin, ck, cv, slots, pos, num_keys, H, KVH, splits=splits, grid=grid)
            assert torch.allclose(got.double(), ref, atol=1e-5), (num_keys, splits, (got - ref).abs().max())
            for other in GRIDS:  # a program per token, per row in turn, per row as one block: the same bits
                again = decode_attention(qkv, cos, sin, ck.clone(), cv.clone(), slots, pos, num_keys, H, KVH,
                                         splits=splits, grid=other)
                assert torch.equal(got, again), (num_keys, splits, grid, other)
            assert torch.allclose(ck, ref_k, atol=1e-6) and torch.equal(cv, ref_v)  # the cache holds what SDPA read
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_verify_of_a_full_batch_reads_each_key_block_once_for_all_its_tokens():
    """The layout a forward gets unless it asks: one block per row for a verify from batch 8 up while tokens x
    heads per KV head fit in 32 rows; a program per token for a decode, a prefill and a small batch."""
    assert default_grid(128, 4, 4) == "row_block" and default_grid(8, 6, 4) == "row_block"
    assert default_grid(128, 1, 4) == "token"      # a decode
    assert default_grid(128, 6, 6) == "token"      # 36 rows: past the block the per-token sums are kept bit for bit
    assert default_grid(4, 4, 4) == "token"        # a small batch: more programs keep the GPU busy
    assert default_grid(8, 32, 4) == "token"       # a short prefill


def test_decode_attention_serves_a_short_prompt_whole(run_interpreted):
    """A prefill of up to MAX_QUERY_TOKENS tokens per row takes the kernel: every token attends causally to the
    prompt's keys written in the same call, as SDPA with the causal mask computes it."""
    out = run_interpreted("""
        import torch, torch.nn.functional as F
        from slime_spec.engine.kernels.decode_attention import MAX_QUERY_TOKENS, decode_attention
        from slime_spec.engine.model_executor.model import apply_rope, causal_mask, rope_cos_sin
        torch.manual_seed(0)
        B, T, H, KVH, D = 2, 20, 4, 2, 32
        assert T <= MAX_QUERY_TOKENS
        qkv = torch.randn(B, T, (H + 2 * KVH) * D)
        slots, pos = torch.tensor([2, 0]), torch.arange(T)[None].expand(B, T)
        cos, sin = rope_cos_sin(pos, D, 10000.0, torch.float32)
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        q = apply_rope(q.reshape(B, T, H, D), cos, sin).transpose(1, 2)
        k = apply_rope(k.reshape(B, T, KVH, D), cos, sin).repeat_interleave(H // KVH, 2).transpose(1, 2)
        v = v.reshape(B, T, KVH, D).repeat_interleave(H // KVH, 2).transpose(1, 2)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=causal_mask(pos, T))
        ck, cv = torch.randn(3, 64, KVH, D), torch.randn(3, 64, KVH, D)
        got = decode_attention(qkv, cos, sin, ck, cv, slots, pos, T, H, KVH)
        assert torch.allclose(got.double(), ref.transpose(1, 2), atol=1e-5), (got - ref.transpose(1, 2)).abs().max()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_gated_gemv_applies_silu_times_up_as_it_loads(run_interpreted):
    out = run_interpreted("""
        import torch, torch.nn.functional as F
        from slime_spec.engine.kernels.gemv import gemv
        torch.manual_seed(0)
        for rows in (1, 5):
            gate_up, w = torch.randn(rows, 2 * 96), torch.randn(40, 96)
            gate, up = gate_up.chunk(2, dim=-1)
            ref = F.linear((F.silu(gate) * up).double(), w.double())
            got = gemv(gate_up, w, gated=True)
            assert torch.allclose(got.double(), ref, atol=1e-4), (got - ref).abs().max()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_silu_and_mul_equals_the_eager_pair_on_strided_rows(run_interpreted):
    """float32 to float32's rounding; bfloat16 within one bf16 step of the exact result of its bf16 inputs (one
    rounding, where the eager pair rounds after the silu too); rows of a wider tensor (strided), leading dimensions
    kept."""
    out = run_interpreted("""
        import torch, torch.nn.functional as F
        from slime_spec.engine.kernels import activation
        activation.BLOCK = 64   # several blocks per row
        torch.manual_seed(0)
        wide = torch.randn(3, 4, 2 * 150 + 8) * 3
        gate_up = wide[..., :300]
        gate, up = gate_up.chunk(2, dim=-1)
        ref = F.silu(gate.double()) * up.double()
        got = activation.silu_and_mul(gate_up)
        assert got.shape == (3, 4, 150) and torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5)
        gate, up = gate_up.bfloat16().double().chunk(2, dim=-1)
        half = activation.silu_and_mul(gate_up.bfloat16()).double()
        assert ((half - F.silu(gate) * up).abs() <= (F.silu(gate) * up).abs() * 2 ** -7 + 1e-6).all()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_rms_norm_equals_hf_rmsnorm_with_and_without_the_residual_add(run_interpreted):
    """float32: the math, to float32 rounding; bf16: the sum and the rounding points (Triton's interpreter rounds
    bf16 toward zero where the GPU rounds to nearest, so here within two bf16 steps; exact on CUDA below)."""
    out = run_interpreted("""
        import torch
        from slime_spec.engine.kernels.rms_norm import rms_norm
        from slime_spec.engine.model_executor.model import RMSNorm
        torch.manual_seed(0)
        for dim, lead in ((96, (3,)), (200, (2, 5))):   # not powers of two; leading dimensions kept
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -6)):
                norm = RMSNorm(dim, 1e-6).to(dtype)
                norm.weight.data = torch.randn(dim).to(dtype)
                x, delta = torch.randn(*lead, dim).to(dtype), torch.randn(*lead, dim).to(dtype)
                y, none = rms_norm(x, norm.weight, 1e-6)
                assert none is None and y.dtype == dtype and y.shape == x.shape
                assert torch.allclose(y.float(), norm(x).float(), rtol=tol, atol=tol), (y - norm(x)).abs().max()
                y, h = rms_norm(x, norm.weight, 1e-6, delta)
                assert torch.allclose(h.float(), (x + delta).float(), rtol=tol, atol=tol)
                ref = norm(x + delta)
                assert torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol), (y - ref).abs().max()
        print("ok")
    """)
    assert out.strip() == "ok"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
def test_cuda_rms_norm_rounds_where_hf_rmsnorm_and_the_add_round():
    from slime_spec.engine.kernels.rms_norm import rms_norm
    from slime_spec.engine.model_executor.model import RMSNorm
    torch.manual_seed(0)
    norm = RMSNorm(1536, 1e-6).to("cuda", torch.bfloat16)
    norm.weight.data = torch.randn(1536, device="cuda").to(torch.bfloat16)
    x, delta = (torch.randn(37, 1536, device="cuda").to(torch.bfloat16) for _ in range(2))
    y, h = rms_norm(x, norm.weight, 1e-6, delta)
    assert torch.equal(h, x + delta)
    ref = norm(x + delta)
    assert (y != ref).float().mean() < 0.01 and torch.allclose(y.float(), ref.float(), rtol=2 ** -7, atol=1e-3)


def test_rms_norm_refuses_a_weight_of_another_width():
    from slime_spec.engine.kernels.rms_norm import rms_norm
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.randn(2, 8), torch.randn(6), 1e-6)


def test_the_model_with_kernels_equals_the_model_without(run_interpreted):
    """Prefills of a prompt longer than the attention kernel takes (SDPA) and of a short one (the kernel), then over
    both rows at their own positions a decode, a 4-token verify (the fused attention), the MTP layer, a 1-row decode
    (the gemv kernels too) and the logits through CausalLM with the kernels on, against the same model with them
    off."""
    out = run_interpreted("""
        import tempfile, torch
        from slime_spec.tools.tiny_model import make_tiny_model
        from slime_spec.engine.model_executor.model import load_model
        from slime_spec.engine.kernels.decode_attention import MAX_QUERY_TOKENS
        from slime_spec.engine.kernels.ops import Kernels
        path = make_tiny_model(tempfile.mkdtemp() + "/m", arch="mimo", mtp_layers=1, hidden_size=128, num_layers=2,
                               num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=97)
        model, _ = load_model(path)
        model.fuse_projections()
        # A prefill takes the kernel up to MAX_QUERY_TOKENS tokens, and the interpreter runs it token by token: one
        # prompt just past that (SDPA), one short.
        long, short = MAX_QUERY_TOKENS + 4, 12
        slots = torch.tensor([1, 0])
        ids = torch.randint(0, 97, (2, long + 5))
        start = torch.tensor([[long], [short]])  # each row's next position
        verify = start + torch.arange(4)
        outs = []
        for kernels in (Kernels(), Kernels(gemv=True, attention=True, norm=True, activation=True)):
            model.use_kernels(kernels)
            cache, mtp_cache = model.new_cache(3, long + 8), model.new_mtp_cache(3, long + 8)
            got = [model.eager_forward(ids[:1, :long], torch.arange(long)[None], cache, slots[:1]),
                   model.eager_forward(ids[1:, :short], torch.arange(short)[None], cache, slots[1:])]
            got.append(model.eager_forward(ids[:, -5:-4], start, cache, slots, num_keys=long + 1))
            got.append(model.eager_forward(ids[:, -5:-1], verify, cache, slots, num_keys=long + 4))
            got.append(model.eager_mtp_forward(ids[:, -5:-1], got[-1], verify, mtp_cache, slots, num_keys=long + 4))
            got.append(model.eager_forward(ids[:1, -1:], start[:1] + 4, cache, slots[:1], num_keys=long + 5))  # gemv
            got += [model.logits(got[2]), model.logits(got[5])]
            outs.append(got)
        for a, b in zip(*outs):
            assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
        print("ok")
    """)
    assert out.strip() == "ok"


ALL_KERNELS = Kernels(gemv=True, attention=True, norm=True, activation=True, sampling=True)


def test_flags_pick_the_kernels():
    assert Kernels.from_values({}) == ALL_KERNELS
    assert Kernels.from_values({"bf16_gemm_backend": "torch"}) == dataclasses.replace(ALL_KERNELS, gemv=False)
    assert Kernels.from_values({"attention_backend": "torch_native"}) == dataclasses.replace(ALL_KERNELS,
                                                                                          attention=False)
    assert Kernels.from_values({"sampling_backend": "pytorch"}) == dataclasses.replace(ALL_KERNELS, sampling=False)
    assert Kernels.from_values({"attention_backend": "fa3", "decode_attention_backend": "torch_native"}).attention \
        is False
    assert Kernels.from_values({"attention_backend": "fa3"}).attention is True  # no fa3 here: the Triton kernel


def test_engine_flags_reach_the_kernels(tmp_path):
    from slime_spec.engine.server_args import parse_server_args
    from slime_spec.tools.tiny_model import make_tiny_model
    path = make_tiny_model(tmp_path / "m", arch="llama", mtp_layers=0, hidden_size=32, num_layers=1, num_heads=2,
                           num_kv_heads=1, intermediate_size=64, vocab_size=64)
    args = parse_server_args(["--model-path", str(path), "--bf16-gemm-backend", "torch", "--attention-backend",
                              "torch_native", "--sampling-backend", "pytorch"], cuda_available=False)
    # the norm and activation kernels have no flag (as in SGLang)
    assert args.kernels == Kernels(norm=True, activation=True) and not args.ignored_flags
    assert parse_server_args(["--model-path", str(path)], cuda_available=False).kernels == ALL_KERNELS


def test_gemv_serves_one_or_two_rows_of_small_matrices_and_splits_depend_on_rows_not_tokens():
    assert serves(1, 2048, 1536) and serves(1, 1536, 1536)
    assert serves(1, 1536, 4096) and serves(2, 1536, 1536) and not serves(4, 2048, 1536) and not serves(1, 8192, 1536)
    assert supports(32) and supports(128) and not supports(16) and not supports(96)
    assert num_splits(1, 2, 256) == 1 and num_splits(1, 2, 2048) == 8 and num_splits(64, 2, 2048) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
def test_cuda_engine_with_kernels_decodes_as_without(tmp_path):
    """Greedy decoding through captured graphs, the kernels on against cuBLAS + SDPA, float32 (IEEE dot products in
    the kernels, TF32 off): the same tokens."""
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
    from slime_spec.tools.tiny_model import make_tiny_model
    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_tiny_model(tmp_path / "m", arch="llama", mtp_layers=0, hidden_size=256, num_layers=4, num_heads=8,
                           num_kv_heads=2, intermediate_size=512, vocab_size=512, max_position_embeddings=1024)
    prompts = torch.randint(3, 512, (4, 24), generator=torch.Generator().manual_seed(0)).tolist()
    outputs = []
    for kernels in (Kernels(), Kernels(gemv=True, attention=True, activation=True)):
        core = EngineCore(str(path), None, device="cuda", max_running_requests=4, kernels=kernels)
        for i, ids in enumerate(prompts):
            core.add_request(Request(rid=str(i), input_ids=ids, params=SamplingParams(
                temperature=0.0, max_new_tokens=300, ignore_eos=True)))
        done = {}
        while core.has_work():
            done.update({o.rid: o.output_ids for o in core.step()})
        outputs.append(done)
    assert outputs[0] == outputs[1]
