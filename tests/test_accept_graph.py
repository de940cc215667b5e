"""A chain verify's acceptance as one captured graph (engine/speculative/accept_graph.py): what it packs for the
commit, on CPU with the sampling kernel in Triton's interpreter; its replays against the same acceptance run eagerly
from the same generator state, and a NEXTN engine sampling through it, on CUDA."""

from __future__ import annotations

import pytest
import torch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")


def test_chain_acceptance_packs_the_accepted_drafts_the_next_token_and_their_logprobs(run_interpreted, tmp_path):
    """From the same generator state, chain_acceptance's columns are accept_unfiltered's results over the lm_head's
    logits: the accepted count, the broken flag, the accepted drafts then the next token (the commit reads those
    a + 1), and the logprobs."""
    out = run_interpreted(f"""
        import torch
        from slime_spec.engine.kernels import sampling
        from slime_spec.engine.model_executor.model import load_model
        from slime_spec.engine.speculative.accept import accept_unfiltered
        from slime_spec.engine.speculative.accept_graph import chain_acceptance
        from slime_spec.tools.tiny_model import make_tiny_model
        sampling.BLOCK = 16
        model = load_model(make_tiny_model({str(tmp_path / "m")!r}, arch="mimo", mtp_layers=1, hidden_size=32,
                                           num_layers=1, vocab_size=24, seed=3))[0]
        g = torch.Generator().manual_seed(5)
        n, k = 6, 3
        hidden = torch.randn(n, k + 1, 32, generator=g)
        hidden[4, 2, 0] = float("nan")  # a row whose logits are not finite
        logits = model.logits(hidden.flatten(0, 1), upcast=False).view(n, k + 1, -1)
        drafts = logits[:, :k].argmax(-1)  # likely drafts, so some rows accept several
        drafts[1] = (drafts[1] + 1) % 24
        temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0, 0.9])
        state = g.get_state()
        accept, chosen, packed = chain_acceptance(model, g, hidden, drafts, temps)
        g.set_state(state)
        a, nxt, logprobs, broken = accept_unfiltered(logits, drafts, temps, g)
        assert torch.equal(accept, a) and broken.tolist() == [False] * 4 + [True, False]
        for i in range(n):
            m = int(a[i])
            assert chosen[i, :m].tolist() == drafts[i, :m].tolist() and int(chosen[i, m]) == int(nxt[i])
        assert packed.dtype == torch.float64 and packed.shape == (n, 2 + 2 * (k + 1))
        assert torch.equal(packed[:, 0], a.double()) and torch.equal(packed[:, 1], broken.double())
        assert torch.equal(packed[:, 2: k + 3], chosen.double())
        assert torch.equal(packed[:, k + 3:], logprobs.double())
        print(*a.tolist())
    """)
    accepted = [int(v) for v in out.split()]
    assert len(accepted) == 6 and accepted[4] == 0 and max(accepted) > 0


@CUDA
def test_replays_draw_what_eager_acceptance_draws_from_the_same_generator_state(tmp_path):
    """Two replays at batch 5 (padded to 8) and one at 8: each equals chain_acceptance run eagerly from the generator
    state before it, so every replay draws fresh noise from the engine's generator, and leaves the generator where
    the eager run leaves it."""
    from slime_spec.engine.model_executor.model import load_model
    from slime_spec.engine.speculative.accept_graph import AcceptGraph, chain_acceptance
    from slime_spec.tools.tiny_model import make_tiny_model
    model = load_model(make_tiny_model(tmp_path / "m", arch="mimo", mtp_layers=1, hidden_size=64, num_layers=1,
                                       vocab_size=1000, dtype="bfloat16", seed=3), dtype="bfloat16", device="cuda")[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    graph = AcceptGraph(model, g, batch_sizes=[4, 8], widths=[4], device=torch.device("cuda"))
    graph.capture()
    eager_g = torch.Generator(device="cuda")
    draws = []
    for n in (5, 5, 8):
        hidden = torch.randn(n, 4, 64, device="cuda", dtype=torch.bfloat16)
        drafts = model.logits(hidden[:, :3].flatten(0, 1)).view(n, 3, -1).argmax(-1)
        temps = torch.rand(n, device="cuda") + 0.5
        eager_g.set_state(g.get_state())
        expected = chain_acceptance(model, eager_g, hidden, drafts, temps)
        got = [t.clone() for t in graph(hidden, drafts, temps)]
        for e, o in zip(expected, got):
            assert torch.equal(e, o)
        assert torch.equal(g.get_state(), eager_g.get_state())
        draws.append(got[2])
    assert graph.calls == 3 and not torch.equal(draws[0][:, 2:], draws[1][:, 2:])


@CUDA
def test_a_nextn_engine_samples_through_the_captured_acceptance(tmp_path):
    """A NEXTN engine on CUDA, every row at temperature 0.8 with logprobs: the chain steps replay the captured
    acceptance, drafts are accepted (the MTP layer a copy of the target's last layer), and the logprobs equal a
    full forward's; rows filtered by top-p take the eager acceptance instead."""
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
    from slime_spec.engine.model_executor.model import load_model
    from slime_spec.tools.tiny_model import make_tiny_model
    from tests.helpers.engine_runs import assert_logprobs_equal_a_full_forward
    from tests.helpers.spec_runs import copy_target_into_mtp
    path = make_tiny_model(tmp_path / "mimo", arch="mimo", mtp_layers=1, hidden_size=64, num_layers=1,
                           vocab_size=96, seed=1)
    engine = EngineCore(str(path), SpecConfig("NEXTN", 3, 1, 4), max_running_requests=8, seed=0, device="cuda")
    copy_target_into_mtp(engine)
    graph = engine.model.graphs["chain_accept"]
    for top_p, replayed in ((1.0, True), (0.9, False)):
        before = graph.calls
        params = SamplingParams(temperature=0.8, top_p=top_p, max_new_tokens=24, ignore_eos=True)
        requests = [Request(f"r{i}{top_p}", [3 + i, 5, 7, 9], params, return_logprob=True) for i in range(6)]
        for r in requests:
            engine.add_request(r)
        outs = {}
        while engine.has_work():
            outs.update({o.rid: o for o in engine.step()})
        assert all(len(o.output_ids) == 24 for o in outs.values())
        assert (graph.calls > before) == replayed
        assert sum(o.spec_accept_token_num for o in outs.values()) > 0
        if replayed:
            assert_logprobs_equal_a_full_forward(load_model(path)[0], requests, outs, "cuda")
