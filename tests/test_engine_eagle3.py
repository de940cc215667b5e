"""EAGLE3 in the embedded engine: the draft equals the trainer's reference, greedy output equals plain
decoding, sampled output follows the target distribution, llama3 RoPE and the target's aux states."""

import json

import pytest
import torch

from slime_spec.common import eagle3_draft
from slime_spec.engine.drafters.eagle3 import load_eagle3_drafter
from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.engine.model_executor.model import load_model
from slime_spec.engine.model_executor.sampling import chi_square_pvalue
from slime_spec.tools.tiny_model import make_tiny_eagle3_draft, make_tiny_model
from tests.helpers.spec_runs import exact_marginals, generate, make_requests

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    llama = make_tiny_model(root / "llama", hidden_size=32, num_layers=4, seed=21)
    v16 = make_tiny_model(root / "v16", vocab_size=16, hidden_size=32, num_layers=4, seed=22)
    rope = make_tiny_model(root / "rope", hidden_size=32, num_layers=4, seed=23)
    config = json.loads((rope / "config.json").read_text())
    (rope / "config.json").write_text(json.dumps({**config, "rope_scaling": LLAMA3_ROPE}))
    return {"llama": llama, "llama_draft": make_tiny_eagle3_draft(root / "ld", llama, draft_vocab_size=40),
            "v16": v16, "v16_draft": make_tiny_eagle3_draft(root / "vd", v16, draft_vocab_size=12),
            "rope": rope, "rope_draft": make_tiny_eagle3_draft(root / "rd", rope, draft_vocab_size=40)}


def test_target_forward_returns_the_aux_layer_outputs(ckpts):
    """The outputs of layers 0, 1, 2 are HF's hidden_states[1..3] (SGLang: the inputs of layers 1, 2, 3)."""
    transformers = pytest.importorskip("transformers")
    model, _ = load_model(ckpts["llama"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpts["llama"]), torch_dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    pos = torch.arange(5)[None]
    plain = model(ids, pos, model.new_cache(1, 8), torch.tensor([0]))
    hidden, aux = model(ids, pos, model.new_cache(1, 8), torch.tensor([0]), aux_layer_ids=[0, 1, 2])
    assert torch.equal(hidden, plain)
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(aux, torch.cat(states[1:4], dim=-1), atol=1e-5, rtol=1e-5)


def test_llama3_rope_matches_transformers(ckpts):
    transformers = pytest.importorskip("transformers")
    model, _ = load_model(ckpts["rope"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpts["rope"]), torch_dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 6])
    pos = torch.arange(ids.shape[1])[None]
    ours = model.logits(model(ids, pos, model.new_cache(1, ids.shape[1]), torch.tensor([0])))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    plain = load_model(ckpts["llama"])[0]  # the scaled frequencies differ from plain RoPE's
    assert not torch.allclose(plain.args.cos_sin(pos, torch.float32)[0], model.args.cos_sin(pos, torch.float32)[0])


def test_engine_draft_steps_equal_the_trainer_reference(ckpts):
    """Extend over a prompt, then chained one-token steps from the cache, equal the reference's whole-row step."""
    target, _ = load_model(ckpts["llama"])
    drafter = load_eagle3_drafter(target, str(ckpts["llama_draft"]), num_steps=3, slots=2, max_seq=32)
    ref = eagle3_draft.load_draft(ckpts["llama_draft"], 4)
    tokens = torch.tensor([[5, 9, 13, 7, 22, 31, 8, 4, 17]])
    n = tokens.shape[1]
    pos = torch.arange(n)[None]
    _, aux = target(tokens, pos, target.new_cache(1, n), torch.tensor([0]), aux_layer_ids=drafter.aux_layer_ids)
    embeds = target.model.embed_tokens(tokens)
    with torch.no_grad():
        ref_logits, ref_out = ref(embeds[:, 1:], aux[:, :-1], pos[:, :-1])
    slots = torch.tensor([1])
    with torch.no_grad():  # prefix by extend, the last position by a one-token cached step
        out_a = drafter.step(tokens[:, 1:-1], aux[:, :-2], pos[:, :-2], slots)
        out_b = drafter.step(tokens[:, -1:], aux[:, -2:-1], pos[:, -2:-1], slots, num_keys=n - 1)
        logits_a, logits_b = drafter.logits(out_a), drafter.logits(out_b)
    torch.testing.assert_close(torch.cat([logits_a, logits_b], 1), ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([out_a, out_b], 1), ref_out, atol=1e-5, rtol=1e-5)
    full = drafter.target_vocab_logits(logits_b[:, 0])
    assert int(full.argmax()) == int(ref.draft_to_target()[logits_b[0, 0].argmax()])
    assert torch.isinf(full).sum() == target.args.vocab_size - 40


def test_greedy_output_equals_plain_decoding(ckpts):
    base_engine = EngineCore(str(ckpts["llama"]), None, max_running_requests=4)
    tok = base_engine.tokenizer
    base = generate(base_engine, make_requests(tok))
    for steps in (1, 3):
        spec = SpecConfig("EAGLE3", steps, 1, steps + 1, str(ckpts["llama_draft"]))
        engine = EngineCore(str(ckpts["llama"]), spec, max_running_requests=4)
        outs = generate(engine, make_requests(tok, temps=[0.0, 0.0, 0.9]), join_every=3)
        for rid, o in base.items():
            if int(rid[1:]) % 3 != 2:
                assert o.output_ids == outs[rid].output_ids, (steps, rid)
        assert any(o.spec_verify_ct for o in outs.values())
        assert 1.0 <= engine.avg_spec_accept_length <= steps + 1


def test_draft_weights_are_served_by_checkpoint_name(ckpts):
    engine = EngineCore(str(ckpts["llama"]), SpecConfig("EAGLE3", 2, 1, 3, str(ckpts["llama_draft"])))
    served = engine.named_weights("draft")
    assert "fc.weight" in served and "midlayer.self_attn.q_proj.weight" in served
    assert "model.embed_tokens.weight" not in served and "d2t" not in served
    new = {n: torch.randn_like(t) for n, t in served.items()}
    engine.load_weights(list(new.items()), selector="draft")
    assert all(torch.equal(engine.named_weights("draft")[n], t) for n, t in new.items())
    assert not torch.equal(engine.named_weights("target")["lm_head.weight"][:40], new["lm_head.weight"])


def test_sampled_output_follows_the_target_distribution(ckpts):
    """Greedy chain drafts (q one-hot on a draft-vocabulary token) verified against sampled targets."""
    prompt, temperature, n = [5, 6, 7, 5, 6], 1.3, 3000
    spec = SpecConfig("EAGLE3", 2, 1, 3, str(ckpts["v16_draft"]))
    engine = EngineCore(str(ckpts["v16"]), spec, max_running_requests=64, seed=0)
    params = SamplingParams(temperature=temperature, max_new_tokens=3, ignore_eos=True)
    for i in range(n):
        engine.add_request(Request(str(i), prompt, params))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert sum(o.spec_accept_token_num for o in outs) > 0.02 * n
    assert sum(o.spec_accept_token_num for o in outs) < sum(o.spec_draft_token_num for o in outs)
    p2, p3 = exact_marginals(str(ckpts["v16"]), prompt, temperature)
    t2 = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=16)
    t3 = torch.bincount(torch.tensor([o.output_ids[2] for o in outs]), minlength=16)
    assert chi_square_pvalue(t2, p2) > 1e-3
    assert chi_square_pvalue(t3, p3) > 1e-3


def _chain_outputs_with_graphs(ckpts, device, capture):
    """EAGLE3 chain k=3 greedy outputs with the aux-returning target forward and the draft head's steps and
    extend served by GraphedForward (captured on CUDA; capture=False runs the same padded shapes eagerly)."""
    from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings
    from slime_spec.engine.model_executor.model_graphs import graph_model
    spec = SpecConfig("EAGLE3", 3, 1, 4, str(ckpts["llama_draft"]))
    engine = EngineCore(str(ckpts["llama"]), spec, max_running_requests=4, device=device)
    if not capture:
        settings = CudaGraphSettings(batch_sizes=(1, 2, 4))
        engine.model.graphs = graph_model(engine.model, engine.cache, None, settings, max_running_requests=4,
                                          max_draft_tokens=3, max_seq=engine.max_seq, capture=False,
                                          aux_layer_ids=engine.drafter.aux_layer_ids)
        engine.drafter.capture_graphs(settings, 4, capture=False)
    assert set(engine.drafter.graphs) == {"step", "extend"} and "target_aux" in engine.model.graphs
    graphs = {"target_aux": engine.model.graphs["target_aux"], **engine.drafter.graphs}
    outs = generate(engine, make_requests(engine.tokenizer, temps=[0.0, 0.0, 0.9]), join_every=3)
    assert all(g.calls > 0 for g in graphs.values()), {n: g.calls for n, g in graphs.items()}
    return outs


def test_graphed_eagle3_chain_equals_plain_decoding(ckpts):
    """The graph dispatch (padding to captured batch sizes, the aux split, the draft's hidden input) keeps greedy
    output plain decoding's; on CPU the padded shapes run eagerly."""
    base = generate(EngineCore(str(ckpts["llama"]), None, max_running_requests=4),
                    make_requests(EngineCore(str(ckpts["llama"]), None).tokenizer))
    outs = _chain_outputs_with_graphs(ckpts, "cpu", capture=False)
    for rid, o in base.items():
        if int(rid[1:]) % 3 != 2:
            assert o.output_ids == outs[rid].output_ids, rid


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
def test_cuda_graphed_eagle3_chain_equals_plain_decoding(ckpts):
    base = generate(EngineCore(str(ckpts["llama"]), None, max_running_requests=4, device="cuda"),
                    make_requests(EngineCore(str(ckpts["llama"]), None).tokenizer))
    outs = _chain_outputs_with_graphs(ckpts, "cuda", capture=True)
    for rid, o in base.items():
        if int(rid[1:]) % 3 != 2:
            assert o.output_ids == outs[rid].output_ids, rid


def test_plain_steps_extend_the_draft_from_the_aux_states(ckpts):
    """Adaptive or auto speculation may take plain steps (k = 0): the draft head then extends over each step's
    position from the target's aux states, as after a verify, so its KV cache holds what one extend over the whole
    sequence writes (a plain step that handed the draft the final hidden state instead would differ)."""
    from tests.test_engine_overlap import CyclingSteps

    spec = SpecConfig("EAGLE3", 3, 1, 4, str(ckpts["llama_draft"]))
    engine = EngineCore(str(ckpts["llama"]), spec, max_running_requests=2)
    engine.spec_worker.policy = CyclingSteps()
    prompt = engine.tokenizer("the plain steps")["input_ids"]
    engine.add_request(Request("r", prompt, SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)))
    done = []
    while engine.has_work():
        done += engine.step()
    seq = prompt + done[0].output_ids
    slot = 1  # free_slots pops from the end: the first request takes the last slot
    n = len(seq) - 4  # positions every step has extended (the last steps may have finished the row first)
    ids = torch.tensor([seq])
    pos = torch.arange(len(seq))[None]
    _, aux = engine.model(ids, pos, engine.model.new_cache(1, len(seq)), torch.tensor([0]),
                          aux_layer_ids=engine.drafter.aux_layer_ids)
    with torch.no_grad():  # the reference extend, into the drafter's spare slot
        engine.drafter.step(ids[:, 1:], aux[:, :-1], pos[:, :-1], torch.tensor([2]))
    cache = engine.drafter.cache.k[0]
    torch.testing.assert_close(cache[slot, :n], cache[2, :n], atol=1e-5, rtol=1e-5)
