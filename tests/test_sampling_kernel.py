"""The sampling kernel (engine/kernels/sampling.py) and the speculative acceptance built on it
(speculative/accept.accept_unfiltered): on CPU in Triton's interpreter (small samples: it runs a program in tens of
milliseconds), on CUDA with samples large enough for tight chi-square tests."""

from __future__ import annotations

import math

import pytest
import torch

from slime_spec.engine.model_executor.sampling import chi_square_pvalue

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")


def test_row_statistics_equal_torchs_and_broken_rows_are_flagged(run_interpreted):
    """logsumexp of x / T over several blocks of the vocabulary, z at the drawn and the probed token, the finite flag,
    float32 and bfloat16 logits; a row whose only finite score is the excluded token's draws that token."""
    out = run_interpreted("""
        import torch
        from slime_spec.engine.kernels import sampling
        sampling.BLOCK = 64   # several blocks per row at this vocabulary
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 200, generator=g) * 3
        x[3, 17], x[4, 5] = float("nan"), float("inf")
        t = torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0])
        probe = torch.tensor([3, -1, 199, 0, 0])
        for logits in (x, x.bfloat16()):
            r = sampling.sample_rows(logits, t, g, probe=probe)
            z = logits.float() / t[:, None]
            assert torch.allclose(r.lse[:3], torch.logsumexp(z, -1)[:3], atol=1e-5, rtol=0)
            assert torch.allclose(r.token_z[:3], z[torch.arange(3), r.tokens[:3]], atol=1e-6, rtol=0)
            assert r.probe_z[1] == 0 and torch.allclose(r.probe_z[[0, 2]], z[[0, 2], [3, 199]])
            assert r.finite.tolist() == [True, True, True, False, False] and r.tokens.dtype == torch.int64
            assert ((r.tokens >= 0) & (r.tokens < 200)).all()
        only = torch.full((1, 200), float("-inf"))
        only[0, 7] = 0.0
        assert sampling.sample_rows(only, torch.ones(1), g, exclude=torch.tensor([7])).tokens.item() == 7
        print("ok")
    """)
    assert out.strip() == "ok"


def test_draws_follow_softmax_and_never_the_excluded_token(run_interpreted):
    out = run_interpreted("""
        import torch
        from slime_spec.engine.kernels import sampling
        from slime_spec.engine.model_executor.sampling import chi_square_pvalue
        sampling.BLOCK = 16
        g = torch.Generator().manual_seed(1)
        V, n = 10, 400
        logits = (torch.randn(V, generator=g) * 1.5).expand(n, V).contiguous()
        p = torch.softmax(logits[0] / 0.8, -1)
        plain = sampling.sample_rows(logits, torch.full((n,), 0.8), g).tokens
        residual = sampling.sample_rows(logits, torch.full((n,), 0.8), g, exclude=torch.full((n,), 2)).tokens
        without = p.clone()
        without[2] = 0.0
        print(chi_square_pvalue(torch.bincount(plain, minlength=V), p),
              chi_square_pvalue(torch.bincount(residual, minlength=V), without / without.sum()),
              int((residual == 2).sum()))
    """)
    plain, residual, drawn_excluded = out.split()
    assert float(plain) > 1e-3 and float(residual) > 1e-3 and drawn_excluded == "0"


def test_accepted_drafts_and_the_next_token_follow_the_target(run_interpreted):
    """k = 1 with a deterministic draft: the first emitted token (the draft if accepted, else the kernel's draw
    without it) follows p; the naive rule (a rejected draft resampled from p itself) would favour the draft. A row
    with a non-finite logit accepts nothing and gets the zeroed logits' logprobs."""
    out = run_interpreted("""
        import math, torch
        from slime_spec.engine.kernels import sampling
        from slime_spec.engine.model_executor.sampling import chi_square_pvalue
        from slime_spec.engine.speculative.accept import accept_unfiltered
        sampling.BLOCK = 16
        g = torch.Generator().manual_seed(2)
        V, n = 8, 400
        logits = torch.randn(2, V, generator=g).expand(n, 2, V).contiguous()
        p = torch.softmax(logits[0, 0], -1)
        draft = int(p.argmax())
        accept, nxt, logprobs, broken = accept_unfiltered(logits, torch.full((n, 1), draft), torch.ones(n), g)
        first = torch.where(accept > 0, torch.full_like(nxt, draft), nxt)
        lp = torch.log_softmax(logits[0], -1)
        expected = torch.where(accept[:, None] > 0, lp[0, draft], lp[0, nxt][:, None])[:, 0]
        assert torch.allclose(logprobs[:, 0], expected, atol=1e-5) and not broken.any()
        bad = logits[:2].clone()
        bad[1, 1, 3] = float("nan")
        a, _, lps, b = accept_unfiltered(bad, torch.full((2, 1), draft), torch.ones(2), g)
        assert b.tolist() == [False, True] and a[1] == 0 and torch.allclose(lps[1], torch.full((2,), -math.log(V)))
        print(chi_square_pvalue(torch.bincount(first, minlength=V), p), float(p[draft]),
              float((accept > 0).float().mean()))
    """)
    pvalue, p_draft, accepted = map(float, out.split())
    assert pvalue > 1e-3 and p_draft > 0.2 and abs(accepted - p_draft) < 0.1


@CUDA
def test_cuda_draws_and_chain_acceptance_follow_the_target():
    """Large samples on the GPU: draws from softmax(x / T) with and without an excluded token; a two-draft chain
    emits p(x1) p(x2 | x1) (the eager joint-distribution test's setting); the same generator state draws the same
    tokens from bfloat16 logits as from their float32 values; logprobs equal log_softmax's at a 152k vocabulary."""
    from slime_spec.engine.kernels.sampling import sample_rows
    from slime_spec.engine.speculative.accept import accept_unfiltered
    g = torch.Generator(device="cuda").manual_seed(0)
    V, n = 64, 200_000
    logits = (torch.randn(V, device="cuda") * 2).expand(n, V).contiguous()
    p = torch.softmax(logits[0] / 0.7, -1).cpu()
    temps = torch.full((n,), 0.7, device="cuda")
    plain = sample_rows(logits, temps, g).tokens.cpu()
    assert chi_square_pvalue(torch.bincount(plain, minlength=V), p) > 1e-3
    residual = sample_rows(logits, temps, g, exclude=torch.full((n,), 5, device="cuda")).tokens.cpu()
    without = p.clone()
    without[5] = 0.0
    assert not (residual == 5).any() and chi_square_pvalue(torch.bincount(residual, minlength=V),
                                                           without / without.sum()) > 1e-3

    V, n = 4, 200_000
    p1 = torch.softmax(torch.randn(V), -1)
    p2 = torch.softmax(torch.randn(V, V), -1)
    chain = torch.stack([p1.log(), p2[1].log(), p2[1].log()]).cuda().expand(n, 3, V).contiguous()
    drafts = torch.tensor([1, 3], device="cuda").expand(n, 2)
    accept, nxt, logprobs, broken = accept_unfiltered(chain, drafts, torch.ones(n, device="cuda"), g)
    first = torch.where(accept > 0, drafts[:, 0], nxt).cpu()
    second = torch.where(accept > 1, drafts[:, 1], nxt)[accept > 0].cpu()
    assert chi_square_pvalue(torch.bincount(first, minlength=V), p1) > 1e-3
    assert chi_square_pvalue(torch.bincount(second, minlength=V), p2[1]) > 1e-3
    assert torch.allclose(logprobs[:, 0].cpu(), torch.where(accept.cpu() > 0, p1[1].log(), p1.log()[first]),
                          atol=1e-5)
    assert not broken.any()

    x = torch.randn(512, 151_936, device="cuda").bfloat16()
    temps = torch.rand(512, device="cuda") + 0.5
    drawn = [sample_rows(logits, temps, torch.Generator(device="cuda").manual_seed(7)) for logits in (x, x.float())]
    assert torch.equal(drawn[0].tokens, drawn[1].tokens)  # the sums may round apart: loads of another width
    torch.testing.assert_close(drawn[0].lse, drawn[1].lse, atol=1e-5, rtol=0)
    z = x.float() / temps[:, None]
    torch.testing.assert_close(drawn[0].token_z - drawn[0].lse,
                               torch.log_softmax(z, -1).gather(1, drawn[0].tokens[:, None])[:, 0], atol=1e-4, rtol=0)
    assert math.isfinite(float(drawn[0].lse.sum()))


@CUDA
def test_cuda_kernel_sampling_and_acceptance_queue_without_waiting_for_the_stream():
    from slime_spec.engine.kernels.sampling import sample_rows
    from slime_spec.engine.speculative.accept import accept_unfiltered
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(8, 4, 1000, device="cuda").bfloat16()
    drafts = torch.randint(1000, (8, 3), device="cuda")
    temps = torch.ones(8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample_rows(logits[:, 0], temps, g)
        accept_unfiltered(logits, drafts, temps, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_a_speculative_engine_samples_and_accepts_through_the_kernel(run_interpreted, tmp_path):
    """The engine's wiring of the kernel (engine_core's pick, SpecWorker's verify and accept) on CPU, the kernel in
    Triton's interpreter: NEXTN rows all sampled at temperature 0.8 with logprobs; the returned logprobs equal a
    full forward's, drafts were verified and some accepted (the MTP layer a copy of the target's last layer)."""
    out = run_interpreted(f"""
        import torch
        from slime_spec.engine.kernels.ops import Kernels
        from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
        from slime_spec.engine.model_executor.model import load_model
        from slime_spec.tools.tiny_model import make_tiny_model
        from tests.helpers.engine_runs import assert_logprobs_equal_a_full_forward
        from tests.helpers.spec_runs import copy_target_into_mtp
        path = make_tiny_model({str(tmp_path / "mimo")!r}, arch="mimo", mtp_layers=1, hidden_size=32, num_layers=2,
                               vocab_size=48, seed=1)
        engine = EngineCore(str(path), SpecConfig("NEXTN", 2, 1, 3), max_running_requests=4, seed=0)
        engine.model.kernels = Kernels(sampling=True)  # CPU forwards take no kernel but this one
        copy_target_into_mtp(engine)
        from slime_spec.engine.managers import engine_core
        from slime_spec.engine.speculative import accept
        calls = {{"pick": 0, "accept": 0}}
        def counting(module, key):
            real = module.sample_rows
            def wrapper(*a, **kw):
                calls[key] += 1
                return real(*a, **kw)
            module.sample_rows = wrapper
        counting(engine_core, "pick")
        counting(accept, "accept")
        params = SamplingParams(temperature=0.8, max_new_tokens=10, ignore_eos=True)
        requests = [Request(f"r{{i}}", [3 + i, 5, 7, 9], params, return_logprob=True) for i in range(3)]
        for r in requests:
            engine.add_request(r)
        outs = {{}}
        while engine.has_work():
            outs.update({{o.rid: o for o in engine.step()}})
        assert all(len(o.output_ids) == 10 for o in outs.values())
        assert_logprobs_equal_a_full_forward(load_model(path)[0], requests, outs, "cpu")
        print(sum(o.spec_verify_ct for o in outs.values()), sum(o.spec_accept_token_num for o in outs.values()),
              calls["pick"], calls["accept"])
    """)
    verifies, accepted, picks, accepts = map(int, out.split())
    assert verifies > 0 and accepted > 0 and picks > 0 and accepts > 0  # the kernel did the sampling


def test_a_row_whose_logits_break_finishes_with_finite_logprobs_through_the_kernel(run_interpreted, tmp_path):
    """A plain engine sampling through the kernel (Triton's interpreter) reads the lm_head's logits unmasked: a row
    whose logits turn NaN mid-decode finishes with SGLang's "NaN happened", and the logprob of its last token is
    -log V (as from zeroed logits), never NaN; the engine then serves the next request."""
    out = run_interpreted(f"""
        import math
        import torch
        from slime_spec.engine.kernels import sampling
        from slime_spec.engine.kernels.ops import Kernels
        from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
        from slime_spec.tools.tiny_model import make_tiny_model
        # one block with masked lanes: the interpreter's argmax (numpy's nanargmax) raises on an all-NaN block,
        # which a GPU's does not; earlier snippets in this process may have set a smaller block
        sampling.BLOCK = 64
        path = make_tiny_model({str(tmp_path / "llama")!r}, arch="llama", hidden_size=32, num_layers=2,
                               vocab_size=48, seed=1)
        engine = EngineCore(str(path), None, max_running_requests=2, seed=0)
        engine.model.kernels = Kernels(sampling=True)
        params = SamplingParams(temperature=0.8, max_new_tokens=8, ignore_eos=True)
        engine.add_request(Request("nan", [3, 5, 7], params, return_logprob=True))
        engine.step()
        engine.step()
        norm = engine.named_weights("target")["model.norm.weight"].clone()
        engine.load_weights([("model.norm.weight", torch.full_like(norm, float("nan")))])
        outs = {{}}
        while engine.has_work():
            outs.update({{o.rid: o for o in engine.step()}})
        broken = outs["nan"]
        assert broken.finish_reason == {{"type": "stop", "matched": "NaN happened"}}, broken.finish_reason
        assert all(math.isfinite(x) for x in broken.output_logprobs), broken.output_logprobs
        assert abs(broken.output_logprobs[-1] + math.log(48)) < 1e-6, broken.output_logprobs
        engine.load_weights([("model.norm.weight", norm)])
        engine.add_request(Request("after", [3, 5], params, return_logprob=True))
        while engine.has_work():
            outs.update({{o.rid: o for o in engine.step()}})
        assert len(outs["after"].output_ids) == 8
        print(len(broken.output_ids))
    """)
    assert int(out) >= 2  # tokens before the logits broke, then the broken step's
