"""EngineCore without speculation: finishing rules, validation, aborts, weights, memory release."""

import pytest
import torch
from safetensors.torch import load_file

from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.speculative.settings import resolve_or_raise
from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.engine_runs import run_to_completion


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("core_models")
    llama = make_tiny_model(root / "llama", hidden_size=32, num_layers=2, seed=21)
    return {"llama": llama, "other": make_tiny_model(root / "other", hidden_size=32, num_layers=2, seed=22),
            "draft": make_tiny_model(root / "draft", hidden_size=32, num_layers=1, seed=23),
            "qwen2": make_tiny_model(root / "qwen2", arch="qwen2", hidden_size=32, num_layers=1, seed=24),
            "mimo": make_tiny_model(root / "mimo", arch="mimo", hidden_size=32, num_layers=1, seed=25)}


def run(engine, *requests):
    return run_to_completion(engine, requests)


def greedy(rid, ids, n=40, **kw):
    return Request(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=n, **kw))


@pytest.fixture(scope="module")
def engine(ckpts):
    return EngineCore(str(ckpts["llama"]), None, max_running_requests=4, context_length=128)


def test_length_stop_string_and_stop_token(engine):
    ids = engine.tokenizer("once upon a time")["input_ids"]
    base = run(engine, greedy("a", ids, ignore_eos=True))["a"]
    assert base.finish_reason == {"type": "length", "length": 40}
    assert base.completion_tokens == 40 and base.prompt_tokens == len(ids)
    assert base.text == engine.tokenizer.decode(base.output_ids, skip_special_tokens=True)
    stop = base.text[12:14]
    cut = base.text.find(stop)
    out = run(engine, greedy("b", ids, ignore_eos=True, stop=[stop]))["b"]
    assert out.finish_reason == {"type": "stop", "matched": stop}
    assert out.text == base.text[:cut] and out.output_ids == base.output_ids[: len(out.output_ids)]
    assert engine.tokenizer.decode(out.output_ids).endswith(stop)
    kept = run(engine, greedy("c", ids, ignore_eos=True, stop=[stop], no_stop_trim=True))["c"]
    assert kept.text == base.text[: cut + len(stop)]
    token = base.output_ids[7]
    first = base.output_ids.index(token)
    out = run(engine, greedy("d", ids, stop_token_ids=[token]))["d"]
    assert out.finish_reason == {"type": "stop", "matched": token}
    assert out.output_ids == base.output_ids[: first + 1]
    assert out.text == engine.tokenizer.decode(base.output_ids[:first])
    # ignore_eos disables stop tokens too, as in SGLang.
    assert run(engine, greedy("e", ids, stop_token_ids=[token], ignore_eos=True))["e"].completion_tokens == 40
    assert 2 in engine.eos_token_ids  # <|eos|> from config, generation_config and tokenizer


def test_bad_requests_are_rejected_with_clear_errors(engine):
    cases = [(greedy("x", []), "empty"), (greedy("x", [5, 999]), "outside the vocabulary"),
             (greedy("x", [5] * 128), "longer than the model's context length"),
             (greedy("x", [5] * 100, n=40), "exceeds the model's maximum context length"),
             (Request("x", [5], SamplingParams(temperature=-1)), "temperature"),
             (Request("x", [5], SamplingParams(top_p=0)), "top_p"),
             (Request("x", [5], SamplingParams(top_k=0)), "top_k"),
             (Request("x", [5], SamplingParams(max_new_tokens=-1)), "max_new_tokens")]
    for req, msg in cases:
        with pytest.raises(ValueError, match=msg):
            engine.add_request(req)
    assert not engine.has_work()
    engine.add_request(greedy("dup", [5, 6]))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request(greedy("dup", [5, 6]))
    engine.abort_all()
    outs = run(engine)
    assert outs["dup"].finish_reason["type"] == "abort"
    zero = run(engine, greedy("z", [5, 6], n=0))["z"]
    assert zero.output_ids == [] and zero.finish_reason == {"type": "length", "length": 0}


def test_abort_running_and_waiting(ckpts):
    engine = EngineCore(str(ckpts["llama"]), None, max_running_requests=2)
    for i in range(3):
        engine.add_request(greedy(f"r{i}", [5, 6, 7 + i], n=30, ignore_eos=True))
    engine.step()
    assert engine.abort("r0") and engine.abort("r2") and not engine.abort("nope")
    outs = run(engine)
    assert outs["r0"].finish_reason["type"] == "abort" and outs["r0"].completion_tokens >= 1
    assert outs["r2"].finish_reason == {"type": "abort", "message": "Abort in waiting queue"}
    assert outs["r1"].completion_tokens == 30
    assert sorted(engine.free_slots) == [0, 1]


def test_sampling_is_seeded_and_top_k_1_is_greedy(ckpts):
    outs = []
    for _ in range(2):
        engine = EngineCore(str(ckpts["llama"]), None, seed=5)
        reqs = [Request(f"s{i}", [5, 6, 7], SamplingParams(temperature=1.0, top_k=3, max_new_tokens=20,
                                                           ignore_eos=True), return_logprob=True) for i in range(4)]
        outs.append(run(engine, *reqs))
    assert all(outs[0][r].output_ids == outs[1][r].output_ids for r in outs[0])
    assert len({tuple(o.output_ids) for o in outs[0].values()}) > 1
    engine = EngineCore(str(ckpts["llama"]), None)
    top1 = Request("t", [5, 6, 7], SamplingParams(temperature=1.0, top_k=1, max_new_tokens=20, ignore_eos=True))
    plain = run(engine, greedy("g", [5, 6, 7], n=20, ignore_eos=True))["g"]
    assert run(engine, top1)["t"].output_ids == plain.output_ids


def test_load_weights_is_all_or_nothing(engine, ckpts):
    ids = engine.tokenizer("weights")["input_ids"]
    before = run(engine, greedy("w0", ids, ignore_eos=True))["w0"].output_ids
    served = {n: t.clone() for n, t in engine.named_weights("target").items()}
    assert set(served) == set(load_file(str(ckpts["llama"] / "model.safetensors")))
    other = load_file(str(ckpts["other"] / "model.safetensors"))
    bad = list(other.items())
    bad.insert(len(bad) // 2, ("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 3)))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight: shape"):
        engine.load_weights(bad, "all")
    with pytest.raises(ValueError, match="model.layers.7.mlp.up_proj.weight: no runner"):
        engine.load_weights(list(other.items()) + [("model.layers.7.mlp.up_proj.weight", torch.zeros(3))], "all")
    with pytest.raises(ValueError, match="dtype"):
        engine.load_weights([("model.norm.weight", torch.ones(32, dtype=torch.int64))])
    with pytest.raises(ValueError, match="no runner"):
        engine.load_weights([("model.norm.weight", torch.ones(32))], "draft")  # no draft model here
    with pytest.raises(ValueError, match="invalid selector"):
        engine.load_weights([("model.norm.weight", torch.ones(32))], "both")
    assert all(torch.equal(t, engine.named_weights("target")[n]) for n, t in served.items())
    engine.load_weights([(n, t.to(torch.bfloat16)) for n, t in other.items()], "target")
    changed = run(engine, greedy("w1", ids, ignore_eos=True))["w1"].output_ids
    assert changed != before
    engine.load_weights(list(served.items()))
    assert run(engine, greedy("w2", ids, ignore_eos=True))["w2"].output_ids == before


def test_selectors_reach_the_runners_sglang_would(ckpts):
    standalone = EngineCore(str(ckpts["llama"]), SpecConfig("STANDALONE", 2, 1, 3, str(ckpts["draft"])))
    draft_names = set(standalone.named_weights("draft"))
    assert draft_names == set(load_file(str(ckpts["draft"] / "model.safetensors")))
    target0 = standalone.named_weights("target")["model.layers.0.mlp.up_proj.weight"].clone()
    draft0 = standalone.named_weights("draft")["model.layers.0.mlp.up_proj.weight"].clone()
    new = [("model.layers.0.mlp.up_proj.weight", torch.full_like(draft0, 0.5))]
    standalone.load_weights(new, "draft")
    assert torch.equal(standalone.named_weights("target")["model.layers.0.mlp.up_proj.weight"], target0)
    assert torch.equal(standalone.named_weights("draft")["model.layers.0.mlp.up_proj.weight"], new[0][1])
    # "all" reaches the external draft too (the hazard behind slime #1177): same-shaped names are overwritten.
    standalone.load_weights([("model.layers.0.mlp.up_proj.weight", torch.full_like(draft0, 0.25))], "all")
    assert float(standalone.named_weights("draft")["model.layers.0.mlp.up_proj.weight"][0, 0]) == 0.25
    assert float(standalone.named_weights("target")["model.layers.0.mlp.up_proj.weight"][0, 0]) == 0.25

    mimo = EngineCore(str(ckpts["mimo"]), SpecConfig("NEXTN", 2, 1, 3))
    draft = mimo.named_weights("draft")
    assert "model.embed_tokens.weight" in draft and "lm_head.weight" in draft
    assert all(n.startswith("model.mtp_layers.0.") for n in draft if "embed" not in n and "lm_head" not in n)
    assert not any("mtp_layers" in n for n in mimo.named_weights("target"))
    with pytest.raises(ValueError, match="no runner"):
        mimo.load_weights([("model.mtp_layers.0.input_proj.weight", torch.zeros(32, 64))], "target")
    with pytest.raises(ValueError, match="no runner"):
        mimo.load_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 32))], "draft")
    # The embedding is shared: loading it through the draft selector changes the target's too.
    mimo.load_weights([("model.embed_tokens.weight", torch.ones_like(draft["model.embed_tokens.weight"]))], "draft")
    assert float(mimo.named_weights("target")["model.embed_tokens.weight"].min()) == 1.0

    qwen = EngineCore(str(ckpts["qwen2"]), None)
    assert "lm_head.weight" not in qwen.named_weights("all")  # tied, as in the checkpoint
    emb = qwen.named_weights("target")["model.embed_tokens.weight"].clone()
    qwen.load_weights([("lm_head.weight", torch.zeros_like(emb))])  # skipped for a tied model, as SGLang does
    assert torch.equal(qwen.named_weights("target")["model.embed_tokens.weight"], emb)


def test_release_and_resume_memory(ckpts):
    spec = resolve_or_raise({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3})
    engine = EngineCore(str(ckpts["llama"]), spec)
    ids = engine.tokenizer("memory memory memory")["input_ids"]
    before = run(engine, greedy("m0", ids, ignore_eos=True))["m0"]
    engine.add_request(greedy("busy", ids))
    with pytest.raises(ValueError, match="idle"):
        engine.release_memory(["kv_cache"])
    run(engine)
    with pytest.raises(ValueError, match="tags"):
        engine.release_memory(["gpu"])
    engine.release_memory(["kv_cache", "weights"])
    assert engine.cache is None and engine.model.lm_head.weight.numel() == 0
    engine.add_request(greedy("m1", ids, ignore_eos=True))
    assert engine.step() == [] and engine.has_work()  # waits while memory is released
    engine.resume_memory(None)
    after = run(engine)["m1"]
    assert after.output_ids == before.output_ids and after.spec_verify_ct == before.spec_verify_ct
    assert engine.flush_cache()


def test_non_finite_logits_finish_the_request_not_the_engine(ckpts):
    for spec in (None, resolve_or_raise({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3})):
        engine = EngineCore(str(ckpts["llama"]), spec)
        norm = engine.named_weights("target")["model.norm.weight"].clone()
        engine.add_request(greedy("ok", [5, 6, 7], n=5, ignore_eos=True))
        engine.step()
        engine.load_weights([("model.norm.weight", torch.full_like(norm, float("nan")))])
        outs = run(engine, Request("nan", [5, 6], SamplingParams(temperature=0.8, max_new_tokens=5)))
        assert outs["ok"].finish_reason == outs["nan"].finish_reason == {"type": "stop", "matched": "NaN happened"}
        engine.load_weights([("model.norm.weight", norm)])
        assert run(engine, greedy("after", [5, 6], n=5, ignore_eos=True))["after"].completion_tokens == 5


class CountingRid(str):
    """A rid that counts how often any rid is compared with it for equality."""

    comparisons = 0

    def __eq__(self, other):
        CountingRid.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_admission_and_abort_are_linear_in_the_number_of_requests(engine):
    """A rid scan per request compared ~n^2/2 times (20k requests took minutes); a rid index compares ~0."""
    n = 3000
    CountingRid.comparisons = 0
    for i in range(n):
        engine.add_request(Request(CountingRid(f"bulk{i}"), [1, 2], SamplingParams(max_new_tokens=1)))
    assert CountingRid.comparisons <= n
    with pytest.raises(ValueError, match="already running"):
        engine.add_request(Request(CountingRid("bulk7"), [3], SamplingParams(max_new_tokens=1)))
    CountingRid.comparisons = 0
    engine.abort_all()
    assert CountingRid.comparisons <= n
    outs = engine.step()
    while engine.has_work():
        outs += engine.step()
    assert len(outs) == n and all(o.finish_reason["type"] == "abort" for o in outs)
    assert engine.flush_cache()


def test_a_mixed_batch_picks_its_sampled_rows_by_index_as_boolean_masks_would(ckpts, monkeypatch):
    """Greedy and sampled rows, some filtered: the pick reads nothing back (no boolean mask, no bool() of a device
    test) and draws bitwise the tokens, from the same generator draws, that picking rows by boolean masks does."""
    from slime_spec.engine.managers.request import Row
    from slime_spec.engine.model_executor import sampling
    from tests.test_engine_sampling import MIXED, mask_reference, no_device_reads

    engine = EngineCore(str(ckpts["llama"]), None, seed=4)
    rows = [Row(Request(f"r{i}", [5, 6], params, return_logprob=i == 2)) for i, params in enumerate(MIXED)]
    logits = torch.randn(len(rows), engine.vocab_size, generator=torch.Generator().manual_seed(9)) * 3
    reference = torch.Generator().set_state(engine.generator.get_state())
    with no_device_reads(monkeypatch):
        tokens, logprobs = engine._pick_on_device(rows, logits)
    p = engine.batch_params(rows)
    sampled = torch.tensor([not sampling.is_greedy(x.temperature, x.top_k) for x in MIXED])
    expected = logits.argmax(-1)
    expected[sampled] = sampling.sample(mask_reference(logits[sampled], p.temps[sampled], p.top_ks[sampled],
                                                       p.top_ps[sampled], p.min_ps[sampled]), reference)
    assert torch.equal(tokens, expected) and torch.equal(engine.generator.get_state(), reference.get_state())
    assert torch.equal(logprobs, sampling.token_logprobs(logits, p.temps, p.greedy, expected))


def test_the_kv_cache_size_is_known_before_it_is_allocated(engine):
    """cache_bytes is what new_cache allocates; a cache larger than the GPU's free memory is refused with the flags
    that size it (on an H200 a MiMo-7B shape at its 32768-token context ran out of memory in a bare CUDA error)."""
    from slime_spec.engine.managers.engine_core import cache_fits_error

    cache = engine.model.new_cache(3, 50)
    assert engine.model.cache_bytes(3, 50) == sum(t.nbytes for t in cache.k + cache.v)
    assert cache_fits_error(10 << 30, 10 << 30, 47, 32768) is None
    error = cache_fits_error(10 << 30, 9 << 30, 47, 32768)
    assert "--max-running-requests 47" in error and "--context-length 32768" in error and "48 slots" in error
    assert "10.0 GiB" in error and "9.0 GiB free" in error
