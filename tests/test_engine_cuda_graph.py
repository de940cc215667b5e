"""The CUDA-graph runner's shape logic (padding, scratch slot, key buckets) runs on CPU too (capture=False),
and on a GPU the engine's greedy output with graphs equals its output without them."""

import pytest
import torch

from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings, GraphedForward, key_buckets
from slime_spec.engine.model_executor.model import CausalLM, ModelArgs

CONFIG = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4,
              tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"])


def test_key_buckets_cover_max_keys():
    assert key_buckets(1024) == [256, 512, 1024]
    assert key_buckets(1000) == [256, 512, 1000]
    assert key_buckets(100) == [100]


def test_padded_static_forward_equals_eager_and_leaves_other_slots_alone():
    torch.manual_seed(0)
    model = CausalLM(ModelArgs.from_hf_config(CONFIG)).eval()
    cache = model.new_cache(5, 64)  # slots 0..3 for requests, 4 = scratch
    graphed = GraphedForward(lambda i, p, s, k: model.eager_forward(i, p, cache, s, k), batch_sizes=[1, 2, 4],
                             token_counts=[1, 3], key_counts=key_buckets(64, 16), scratch_slot=4, device="cpu",
                             cache=cache)
    with torch.no_grad():
        ids = torch.randint(0, 100, (3, 10))
        slots = torch.tensor([0, 2, 3])
        model(ids, torch.arange(10)[None].expand(3, 10), cache, slots)
        untouched = cache.k[0][1].clone()
        nxt = torch.randint(0, 100, (3, 3))
        pos = 10 + torch.arange(3)[None].expand(3, 3)
        assert graphed.shape_for(3, 3, 13) == (4, 3, 16)
        assert graphed.serves(cache, nxt, 13) and not graphed.serves(model.new_cache(5, 64), nxt, 13)
        assert not graphed.serves(cache, nxt, None) and graphed.shape_for(3, 2, 13) is None
        out = graphed(nxt, pos, slots, 13)
        assert torch.equal(cache.k[0][1], untouched)  # padding wrote only into the scratch slot
        ref = model.eager_forward(nxt, pos, cache, slots)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def greedy_outputs(core) -> dict[str, list[int]]:
    """Five prompts of different lengths decoded greedily to their own lengths: rid -> output ids."""
    from slime_spec.engine.managers.engine_core import Request, SamplingParams
    for i, text in enumerate(["abc", "hello world", "1+1=", "zz", "a longer prompt than the others"]):
        core.add_request(Request(rid=str(i), input_ids=core.tokenizer.encode(text),
                                 params=SamplingParams(temperature=0.0, max_new_tokens=8 + 5 * i, ignore_eos=True)))
    done = {}
    while core.has_work():
        done.update({o.rid: o.output_ids for o in core.step()})
    return done


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_greedy_output_is_the_same_with_and_without_cuda_graphs(tmp_path):
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings
    from slime_spec.speculative.settings import SpecConfig
    from slime_spec.tools.tiny_model import make_tiny_model
    model = make_tiny_model(tmp_path / "m", arch="mimo", mtp_layers=1, hidden_size=64, num_layers=2)
    spec = SpecConfig("EAGLE", 3, 1, 4)
    outputs = []
    for settings, s, overlap in ((CudaGraphSettings(disable=True), None, False), (CudaGraphSettings(), None, None),
                                 (CudaGraphSettings(disable=True), None, None), (CudaGraphSettings(disable=True), spec,
                                 None), (CudaGraphSettings(), spec, None)):
        core = EngineCore(str(model), s, dtype="float32", device="cuda", max_running_requests=4, cuda_graph=settings,
                          overlap_schedule=overlap)
        assert bool(core.model.graphs) == (not settings.disable)
        assert (core.overlap is not None) == (overlap is None)  # on by default: plain decoding, a chain's plain steps
        outputs.append(greedy_outputs(core))
    assert all(out == outputs[0] for out in outputs)


def test_fused_projections_give_the_same_output_and_take_in_place_updates():
    torch.manual_seed(0)
    model = CausalLM(ModelArgs.from_hf_config({**CONFIG, "architectures": ["Qwen2ForCausalLM"],
                                              "model_type": "qwen2"})).eval()
    cache = model.new_cache(2, 64)
    ids, pos, slots = torch.randint(0, 100, (2, 7)), torch.arange(7)[None].expand(2, 7), torch.tensor([0, 1])
    with torch.no_grad():
        ref = model(ids, pos, cache, slots)
        names = [n for n, _ in model.named_parameters()]
        model.fuse_projections()
        assert [n for n, _ in model.named_parameters()] == names
        torch.testing.assert_close(model(ids, pos, cache, slots), ref, rtol=1e-5, atol=1e-5)
        layer = model.model.layers[0]
        layer.self_attn.k_proj.weight.copy_(torch.zeros_like(layer.self_attn.k_proj.weight))
        layer.mlp.up_proj.weight.mul_(2.0)
        fused = model(ids, pos, cache, slots)
        model.unfuse_projections()
        torch.testing.assert_close(model(ids, pos, cache, slots), fused, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(fused, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_standalone_draft_steps_replay_graphs_and_keep_greedy_output(tmp_path):
    """A STANDALONE draft model's one-token chain steps replay their own graphs; greedy output is unchanged."""
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
    from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings
    from slime_spec.speculative.settings import resolve_or_raise
    from slime_spec.tools.tiny_model import make_tiny_model
    target = make_tiny_model(tmp_path / "t", arch="llama", mtp_layers=0, hidden_size=64, num_layers=2, seed=1)
    draft = make_tiny_model(tmp_path / "d", arch="llama", mtp_layers=0, hidden_size=64, num_layers=1, seed=2)
    spec = resolve_or_raise({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft),
                             "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                             "speculative_num_draft_tokens": 4})
    outputs = []
    for settings in (CudaGraphSettings(disable=True), CudaGraphSettings()):
        core = EngineCore(str(target), spec, dtype="float32", device="cuda", max_running_requests=4,
                          cuda_graph=settings)
        assert bool(core.drafter.draft.graphs) == (not settings.disable)
        for i, text in enumerate(["abc", "hello world", "1+1="]):
            core.add_request(Request(rid=str(i), input_ids=core.tokenizer.encode(text),
                                     params=SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)))
        done = {}
        while core.has_work():
            done.update({o.rid: o.output_ids for o in core.step()})
        outputs.append(done)
    assert outputs[0] == outputs[1]


def test_capture_runs_with_garbage_collected_and_the_collector_frozen():
    """SGLang's freeze_gc: a dead cycle (a dropped engine holding graphs or pinned buffers) is collected before
    capture, not during it; --enable-cudagraph-gc leaves the collector alone."""
    import gc
    import weakref

    from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings, freeze_gc
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    dead = weakref.ref(a)
    del a, b
    frozen_before = gc.get_freeze_count()
    with freeze_gc(False):
        assert dead() is None and gc.get_freeze_count() > frozen_before
    assert gc.get_freeze_count() == frozen_before
    with freeze_gc(True):
        assert gc.get_freeze_count() == frozen_before
    assert CudaGraphSettings.from_values({"enable_cudagraph_gc": True}).enable_cudagraph_gc


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_llama31_rope_target_captures_graphs(tmp_path):
    """Llama-3.1's rescaled RoPE frequencies are computed once on the device: a forward that copied them from the
    host could not be captured (and stalled the stream eagerly)."""
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
    from slime_spec.tools.tiny_model import LLAMA31_ROPE_SCALING, make_tiny_model
    model = make_tiny_model(tmp_path / "m", hidden_size=64, num_layers=2, rope_scaling=LLAMA31_ROPE_SCALING)
    outputs = []
    for settings in (CudaGraphSettings(disable=True), CudaGraphSettings()):
        core = EngineCore(str(model), None, dtype="float32", device="cuda", max_running_requests=4,
                          cuda_graph=settings)
        assert bool(core.model.graphs) == (not settings.disable)
        core.add_request(Request(rid="r", input_ids=[5, 6, 7, 8],
                                 params=SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)))
        while core.has_work():
            outputs += [o.output_ids for o in core.step()]
    assert outputs[0] == outputs[1]


def test_mtp_chain_graph_drafts_what_the_step_by_step_chain_drafts(tmp_path):
    """The whole greedy MTP chain as one padded static forward (capture=False: the graph's shapes, run eagerly on
    CPU) gives the tokens the step-by-step chain gives, for every k, on a batch padded to a captured size."""
    from slime_spec.engine.drafters.base import argmax_pick
    from slime_spec.engine.drafters.mtp import MTPDrafter
    from slime_spec.engine.managers.request import Row
    from slime_spec.engine.model_executor.model import load_model
    from slime_spec.engine.model_executor.model_graphs import graph_model, mtp_chain_name
    from slime_spec.tools.tiny_model import make_tiny_model
    path = make_tiny_model(tmp_path / "m", arch="mimo", mtp_layers=1, hidden_size=64, num_layers=2, vocab_size=128)
    model, _ = load_model(path)
    drafter = MTPDrafter(model, 4, slots=5, max_seq=64)
    cache = model.new_cache(5, 64)
    graphs = graph_model(model, cache, drafter.cache, CudaGraphSettings(batch_sizes=(1, 4)), max_running_requests=4,
                         max_draft_tokens=4, max_seq=64, capture=False, chain_lengths=(1, 2, 3, 4))
    assert {mtp_chain_name(k) for k in range(1, 5)} <= set(graphs)
    torch.manual_seed(0)
    rows = [Row(req=None, slot=slot, tokens=torch.randint(0, 128, (n,)).tolist(), kv_len=n - 1)
            for slot, n in zip((2, 0, 3), (7, 12, 9))]
    drafter.next_hidden.copy_(torch.randn_like(drafter.next_hidden))
    with torch.no_grad():
        for c in drafter.cache.k + drafter.cache.v:  # context keys/values: a step at a wrong position reads others
            c.normal_()
        context = [c.clone() for c in drafter.cache.k + drafter.cache.v]
        for k in (1, 2, 4):
            drafter.num_steps = k
            model.graphs = {}
            eager, _ = drafter.sample_draft(rows, argmax_pick)
            written = [c.clone() for c in drafter.cache.k + drafter.cache.v]
            for c, before in zip(drafter.cache.k + drafter.cache.v, context):
                c.copy_(before)
            model.graphs = graphs
            calls = graphs[mtp_chain_name(k)].calls
            whole, q = drafter.sample_draft(rows, argmax_pick)
            assert graphs[mtp_chain_name(k)].calls == calls + 1 and q is None
            assert whole.shape == (3, k) and torch.equal(whole, eager), (k, whole, eager)
            for c, ref in zip(drafter.cache.k + drafter.cache.v, written):  # the same keys/values at the same places
                torch.testing.assert_close(c[:4], ref[:4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_chain_drafted_ahead_of_the_read_back_is_the_chain_the_next_step_would_draft(tmp_path):
    """MTPDrafter._draft_ahead queues the next step's greedy chain before the read-back; the next step takes it for
    the rows it covers (a finished row dropped, new rows drafted afresh). Each time it is taken it must equal the
    chain drafted then, and greedy output stays the plain engine's."""
    from slime_spec.engine.drafters.base import argmax_pick
    from slime_spec.engine.managers.engine_core import EngineCore
    from slime_spec.speculative.settings import SpecConfig
    from slime_spec.tools.tiny_model import make_tiny_model
    model = make_tiny_model(tmp_path / "m", arch="mimo", mtp_layers=1, hidden_size=64, num_layers=2)
    outputs = []
    for spec in (None, SpecConfig("EAGLE", 3, 1, 4)):
        core = EngineCore(str(model), spec, dtype="float32", device="cuda", max_running_requests=4)
        taken, same = [], []
        if spec is not None:
            mtp = core.drafter.mtp
            take = mtp._take_ahead

            def checked(rows, take=take, mtp=mtp):
                got = take(rows)
                if got is not None:
                    taken.append(len(rows))
                    same.append(torch.equal(got, mtp.sample_draft(rows, argmax_pick)[0]))
                return got

            mtp._take_ahead = checked
        outputs.append(greedy_outputs(core))
        if spec is not None:
            assert len(taken) >= 5 and sum(same) >= 0.9 * len(same), (taken, same)
    assert outputs[0] == outputs[1]


def test_prefills_padded_to_a_captured_width_keep_greedy_output(tmp_path):
    """Prefills through the captured widths (model_graphs.prefill_graphs, run eagerly here with their padding: a
    prompt padded to 16 or 32 tokens, a batch of 3 to 4 rows) give the eager prefill's outputs; a prompt wider than
    every captured width runs eagerly."""
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
    from slime_spec.engine.model_executor.model_graphs import graph_model
    from slime_spec.tools.tiny_model import make_tiny_model
    path = make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, max_position_embeddings=256)
    outs = []
    for graphed in (False, True):
        core = EngineCore(str(path), None, max_running_requests=4, context_length=200)
        if graphed:
            graphs = graph_model(core.model, core.cache, None, CudaGraphSettings(batch_sizes=(1, 4)),
                                 max_running_requests=4, max_draft_tokens=0, max_seq=core.max_seq, capture=False,
                                 prefill=True)
            core.model.graphs = {n: g for n, g in graphs.items() if n.startswith("prefill")}
            assert sorted(core.model.graphs) == ["prefill128", "prefill16", "prefill32", "prefill64"]
        out = greedy_outputs(core)
        long = core.tokenizer.encode("x" * 150)
        core.add_request(Request(rid="long", input_ids=long, params=SamplingParams(temperature=0.0, max_new_tokens=4)))
        while core.has_work():
            out.update({o.rid: o.output_ids for o in core.step()})
        outs.append(out)
        if graphed:
            calls = {n: g.calls for n, g in core.model.graphs.items()}
            assert calls["prefill16"] > 0 and calls["prefill32"] > 0 and calls["prefill128"] == 0, calls
    assert outs[0] == outs[1]


@pytest.mark.parametrize("policy", ["fixed", "adaptive", "auto"])
def test_every_decode_forward_has_a_graph_of_its_width(tmp_path, policy):
    """The target's and the MTP layer's graphs are captured only for the widths the step policy's decode steps run
    (`verify_widths`: k + 1 for fixed speculation, where the graphs of every width up to k + 1 took twice the capture
    time); each decode-time forward, sampled or greedy, must find a graph of its width (capture=False runs the
    graphs' padded shapes eagerly on CPU), leaving only the MTP layer's extends over whole prompts to run eagerly."""
    from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
    from slime_spec.engine.model_executor.model_graphs import graph_model
    from slime_spec.speculative.settings import resolve_or_raise
    from slime_spec.tools.tiny_model import make_tiny_model
    from tests.helpers.engine_runs import run_to_completion
    path = make_tiny_model(tmp_path / "m", arch="mimo", mtp_layers=1, hidden_size=64, num_layers=2)
    spec = resolve_or_raise({"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                             "speculative_num_draft_tokens": 4, "speculative_adaptive": policy == "adaptive"})
    core = EngineCore(str(path), spec, max_running_requests=8, spec_auto=policy == "auto")
    widths = core.policy.verify_widths()
    assert widths == {"fixed": (4,), "adaptive": (1, 2, 4, 6, 8), "auto": (1, 2, 3, 4)}[policy]
    sizes = CudaGraphSettings(batch_sizes=(1, 4, 8))
    core.model.graphs = graph_model(core.model, core.cache, core.drafter.mtp.cache, sizes, max_running_requests=8,
                                    max_draft_tokens=core.policy.max_num_steps, max_seq=core.max_seq, capture=False,
                                    chain_lengths=core.policy.draft_lengths(), verify_widths=widths)
    eager = []
    for name in ("eager_forward", "eager_mtp_forward"):
        run = getattr(core.model, name)

        def counted(*args, run=run, name=name, **kwargs):
            if not kwargs.get("graphed"):
                eager.append((name, args[0].shape[1]))
            return run(*args, **kwargs)
        setattr(core.model, name, counted)
    ids = core.tokenizer("hello there " * 3)["input_ids"]
    for temperature in (0.0, 1.0):
        requests = [Request(f"{temperature}-{i}", ids[:5 + i], SamplingParams(temperature=temperature,
                                                                              max_new_tokens=30 + 3 * i,
                                                                              ignore_eos=True)) for i in range(8)]
        outs = run_to_completion(core, requests)
        assert all(len(o.output_ids) == r.params.max_new_tokens for o, r in zip(outs.values(), requests))
    prompts = {len(ids[:5 + i]) for i in range(8)}  # prefills, and the MTP layer's extends over them
    assert {w for name, w in eager if name == "eager_forward"} <= prompts, eager
    # wider than any graph: an MTP extend deferred over many plain steps (adaptive, auto), eager as before
    assert all(w in prompts or w > widths[-1] for name, w in eager if name == "eager_mtp_forward"), eager
