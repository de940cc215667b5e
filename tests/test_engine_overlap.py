"""The overlap schedule (engine/managers/overlap.py): launching step t + 1 before reading step t changes no output.

On CPU the schedule runs synchronously, so these tests pin its bookkeeping (device-side last tokens, dropped tokens
of rows that finished while a step was in flight, admission into freed slots, aborts, logprobs); the GPU run of
tests/test_engine_cuda_graph.py covers it with real asynchrony.
"""

import pytest
import torch

from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
from slime_spec.speculative.settings import resolve_or_raise
from slime_spec.tools.tiny_model import make_tiny_model
from tests.helpers.spec_runs import copy_target_into_mtp


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("overlap") / "llama", hidden_size=32, num_layers=2, seed=31)


def run(engine, requests, abort_after: dict[str, int] | None = None):
    for r in requests:
        engine.add_request(r)
    outs, steps = {}, 0
    while engine.has_work():
        for o in engine.step():
            outs[o.rid] = o
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(rid)
    return outs


def requests(engine, sampled: bool = False):
    """More requests than slots, mixed lengths and stops, one finishing at its first token."""
    prompts = ["once upon a time", "the cat", "a b c d e", "hello", "x", "in the beginning", "so it goes"]
    out = []
    for i, text in enumerate(prompts):
        ids = engine.tokenizer(text)["input_ids"]
        params = SamplingParams(temperature=1.0 if sampled else 0.0, max_new_tokens=[1, 5, 17, 30, 9, 2, 23][i],
                                ignore_eos=i % 2 == 0)
        out.append(Request(f"r{i}", ids, params, return_logprob=i % 3 == 0))
    return out


def engines(llama, **kw):
    plain = EngineCore(str(llama), None, max_running_requests=3, context_length=96, overlap_schedule=False, **kw)
    overlap = EngineCore(str(llama), None, max_running_requests=3, context_length=96, overlap_schedule=True, **kw)
    return plain, overlap


def test_greedy_outputs_finishes_and_logprobs_equal_the_plain_schedule(llama):
    plain, overlap = engines(llama)
    assert overlap.overlap is not None and plain.overlap is None
    a, b = run(plain, requests(plain)), run(overlap, requests(overlap))
    assert a.keys() == b.keys() == {f"r{i}" for i in range(7)}
    for rid in a:
        assert b[rid].output_ids == a[rid].output_ids, rid
        assert b[rid].finish_reason == a[rid].finish_reason, rid
        if a[rid].output_logprobs is not None:
            assert b[rid].output_logprobs == pytest.approx(a[rid].output_logprobs, abs=1e-5)
    assert not overlap.has_work() and overlap.overlap.in_flight is None
    assert sorted(overlap.free_slots) == [0, 1, 2]


def test_stop_token_mid_output_drops_the_token_in_flight(llama):
    plain, overlap = engines(llama)
    ids = plain.tokenizer("once upon a time")["input_ids"]
    base = run(plain, [Request("a", ids, SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True))])["a"]
    stop = base.output_ids[6]
    first = base.output_ids.index(stop)
    params = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=[stop])
    out = run(overlap, [Request("b", ids, params)])["b"]
    assert out.output_ids == base.output_ids[: first + 1]
    assert out.finish_reason == {"type": "stop", "matched": stop}


def test_abort_while_a_step_is_in_flight(llama):
    plain, overlap = engines(llama)
    reqs = requests(overlap)
    outs = run(overlap, reqs, abort_after={"r3": 4})
    assert outs["r3"].finish_reason["type"] == "abort"
    full = run(plain, requests(plain))
    assert outs["r3"].output_ids == full["r3"].output_ids[: len(outs["r3"].output_ids)]
    assert outs["r2"].output_ids == full["r2"].output_ids  # the others are untouched


def test_sampled_rows_run_and_stay_in_the_vocabulary(llama):
    _, overlap = engines(llama, seed=3)
    outs = run(overlap, requests(overlap, sampled=True))
    for o in outs.values():
        assert 1 <= len(o.output_ids) and all(0 <= t < overlap.vocab_size for t in o.output_ids)
        assert o.completion_tokens == len(o.output_ids)


def test_release_memory_reads_the_step_in_flight_first(llama):
    _, overlap = engines(llama)
    ids = overlap.tokenizer("hello")["input_ids"]
    overlap.add_request(Request("a", ids, SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)))
    done = []
    while not done:
        done = overlap.step()
    assert overlap.overlap.in_flight is not None  # a step launched for a row that finished meanwhile
    overlap.release_memory(["kv_cache"])
    assert overlap.overlap.in_flight is None and overlap.cache is None
    overlap.resume_memory(["kv_cache"])
    assert run(overlap, [Request("b", ids, SamplingParams(temperature=0.0, max_new_tokens=3))])["b"].output_ids


class CyclingSteps:
    """Test double for a step policy: k from a fixed cycle (0 = a plain step), so a run mixes plain runs of several
    lengths with speculative steps, as adaptive or auto speculation does."""

    CYCLE = [0, 0, 2, 0, 3, 1, 0, 0, 0, 2, 3, 0]

    def __init__(self):
        self.max_num_steps, self.i = 3, 0

    def choose(self, batch_size: int) -> int:
        self.i += 1
        return self.CYCLE[self.i % len(self.CYCLE)]

    def observe(self, *args, **kwargs) -> None:
        return None


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                               reason="needs a CUDA device (runs on the GPU machine)"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ["NEXTN", "STANDALONE"])
def test_plain_steps_of_speculative_engines_overlap_without_changing_output_or_drafts(tmp_path, llama, algorithm,
                                                                                     device):
    """The k = 0 steps of a chain engine run through the overlap schedule: greedy outputs, finishes and logprobs
    equal the schedule without overlap, and so do verify and accept counts, which pins the drafter's bookkeeping of
    overlapped steps (MTP's deferred extend at read-back, STANDALONE's catch-up): a wrong position or hidden state
    would change the drafts."""
    if algorithm == "NEXTN":
        target = make_tiny_model(tmp_path / "mimo", arch="mimo", hidden_size=32, num_layers=1, seed=5)
        spec = resolve_or_raise({"speculative_algorithm": "NEXTN", "speculative_num_steps": 3,
                                 "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4})
    else:
        target = llama
        spec = resolve_or_raise({"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3,
                                 "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
                                 "speculative_draft_model_path": str(llama)})
    outs, caches = [], []
    for overlap in (False, True):
        # Every request admitted at once: a step choice is then never spent on rows that all finish in the drain
        # before it (with overlap), so both runs take the same k at the same step.
        engine = EngineCore(str(target), spec, max_running_requests=7, context_length=96, overlap_schedule=overlap,
                            device=device)
        assert (engine.overlap is not None) == overlap
        engine.spec_worker.policy = CyclingSteps()
        if algorithm == "NEXTN":
            copy_target_into_mtp(engine)  # a draft that is often right: its drafts depend on its KV cache
        outs.append(run(engine, requests(engine)))
        caches.append(engine.drafter.mtp.cache.k[0] if algorithm == "NEXTN" else engine.drafter.cache.k[0])
    a, b = outs
    assert torch.equal(caches[0], caches[1])  # the draft's keys: every deferred extend at its own position
    assert a.keys() == b.keys() == {f"r{i}" for i in range(7)}
    for rid in a:
        assert b[rid].output_ids == a[rid].output_ids, rid
        assert b[rid].finish_reason == a[rid].finish_reason, rid
        assert (b[rid].spec_verify_ct, b[rid].spec_accept_token_num) == \
            (a[rid].spec_verify_ct, a[rid].spec_accept_token_num), rid
        if a[rid].output_logprobs is not None:
            assert b[rid].output_logprobs == pytest.approx(a[rid].output_logprobs, abs=1e-5), rid
    assert sum(o.spec_accept_token_num for o in b.values()) > 20
    if algorithm == "STANDALONE":  # a draft equal to the target: every draft is accepted while it stays in sync
        assert all(o.spec_accept_token_num == o.spec_draft_token_num > 0 for o in b.values() if o.completion_tokens > 8)


def test_overlap_schedule_refuses_drafters_that_need_every_step(tmp_path, llama):
    """NGRAM (its trie learns from every step) and trees (their steps never run plain) do not overlap; chain
    drafters on CPU default to no overlap (it is on by default on CUDA)."""
    ngram = resolve_or_raise({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3})
    with pytest.raises(ValueError, match="overlap_schedule=True"):
        EngineCore(str(llama), ngram, overlap_schedule=True)
    assert EngineCore(str(llama), ngram).overlap is None
    mimo = make_tiny_model(tmp_path / "mimo", arch="mimo", hidden_size=32, num_layers=1, seed=5)
    chain = resolve_or_raise({"speculative_algorithm": "NEXTN", "speculative_num_steps": 2,
                              "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3})
    assert EngineCore(str(mimo), chain).overlap is None
    assert EngineCore(str(mimo), chain, overlap_schedule=True).overlap is not None
    tree = resolve_or_raise({"speculative_algorithm": "NEXTN", "speculative_num_steps": 2,
                             "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4})
    with pytest.raises(ValueError, match="overlap_schedule=True"):
        EngineCore(str(mimo), tree, overlap_schedule=True)


def test_overlap_eligibility_is_the_drafters_capability(llama, monkeypatch):
    """Which chains' plain steps overlap is each drafter's `defers_plain_steps`, not a list in the engine."""
    from slime_spec.engine.drafters import (
        Eagle3Drafter,
        HistoryDrafter,
        HybridDrafter,
        MTPDrafter,
        NgramDrafter,
        StandaloneDrafter,
    )

    expected = {MTPDrafter: True, HybridDrafter: True, StandaloneDrafter: True, Eagle3Drafter: False,
                NgramDrafter: False, HistoryDrafter: False}
    assert {cls: cls.defers_plain_steps for cls in expected} == expected
    spec = resolve_or_raise({"speculative_algorithm": "STANDALONE", "speculative_num_steps": 2,
                             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3,
                             "speculative_draft_model_path": str(llama)})
    assert EngineCore(str(llama), spec, overlap_schedule=True).overlap is not None
    monkeypatch.setattr(StandaloneDrafter, "defers_plain_steps", False)
    with pytest.raises(ValueError, match="overlap_schedule=True"):
        EngineCore(str(llama), spec, overlap_schedule=True)


@pytest.mark.parametrize("speculative", [False, True])
def test_rows_just_prefilled_are_put_on_the_device_once(tmp_path, llama, speculative):
    """A prefilled row's first token goes to the device buffer once in the step that admits it: by the engine
    when a plain step is in flight (or without speculation), else by the speculative engine's next plain step,
    which puts every row's token after a speculative step."""
    engine = engines(llama)[1]
    if speculative:
        spec = resolve_or_raise({"speculative_algorithm": "STANDALONE", "speculative_num_steps": 2,
                                 "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3,
                                 "speculative_draft_model_path": str(llama)})
        engine = EngineCore(str(llama), spec, max_running_requests=3, context_length=96, overlap_schedule=True)
        engine.spec_worker.policy = CyclingSteps()
    put, step = [], [0]
    after_prefill = engine.overlap.after_prefill
    engine.overlap.after_prefill = lambda rows: put.extend((step[0], r.req.rid) for r in rows) or after_prefill(rows)
    for r in requests(engine):
        engine.add_request(r)
    while engine.has_work():
        step[0] += 1
        engine.step()
    assert put and len(put) == len(set(put))


def _install_decode_graph(engine, mtp_cache=None, max_draft_tokens: int = 0):
    """The whole plain step as the engine captures it on CUDA ("decode", engine/model_executor/decode_graph.py), run
    eagerly
    (capture=False) with its padding (batch 1 pads to 2); the engine's other graphs are left out."""
    from slime_spec.engine.model_executor.cuda_graph import CudaGraphSettings
    from slime_spec.engine.model_executor.model_graphs import graph_model
    engine.model.graphs = graph_model(engine.model, engine.cache, mtp_cache, CudaGraphSettings(batch_sizes=(2, 3)),
                                      max_running_requests=engine.max_running_requests,
                                      max_draft_tokens=max_draft_tokens, max_seq=engine.max_seq, capture=False,
                                      last_token=engine.overlap.last_token)
    engine.model.graphs = {"decode": engine.model.graphs["decode"]}
    return engine.model.graphs["decode"]


def test_the_captured_plain_step_keeps_outputs_finishes_and_logprobs(llama):
    """The overlap schedule's step through the captured whole step (its eager twin on CPU: padding, the token buffer
    read and written inside, the packed read-back) gives the plain schedule's greedy outputs, finishes and logprobs;
    sampled rows are picked from its logits and stay in the vocabulary."""
    plain, overlap = engines(llama)
    step = _install_decode_graph(overlap)
    a, b = run(plain, requests(plain)), run(overlap, requests(overlap))
    assert step.calls > 0
    assert a.keys() == b.keys() == {f"r{i}" for i in range(7)}
    for rid in a:
        assert b[rid].output_ids == a[rid].output_ids, rid
        assert b[rid].finish_reason == a[rid].finish_reason, rid
        if a[rid].output_logprobs is not None:
            assert b[rid].output_logprobs == pytest.approx(a[rid].output_logprobs, abs=1e-5), rid
    _, sampled = engines(llama, seed=3)
    calls = _install_decode_graph(sampled).calls
    outs = run(sampled, requests(sampled, sampled=True))
    assert sampled.model.graphs["decode"].calls > calls
    assert all(0 <= t < sampled.vocab_size for o in outs.values() for t in o.output_ids)
    assert sum(len(o.output_ids) for o in outs.values()) == sum(len(o.output_ids) for o in a.values())


def test_plain_steps_of_a_chain_through_the_captured_step_keep_drafts(tmp_path):
    """A NEXTN engine's plain steps through the captured step: the MTP layer's deferred extends read each step's
    hidden states after the next step was launched (copied out of the graph's buffer), so its accept counts and
    the draft's keys equal the run without overlap."""
    target = make_tiny_model(tmp_path / "mimo", arch="mimo", hidden_size=32, num_layers=1, seed=5)
    spec = resolve_or_raise({"speculative_algorithm": "NEXTN", "speculative_num_steps": 3,
                             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4})
    outs, caches = [], []
    for overlap in (False, True):
        engine = EngineCore(str(target), spec, max_running_requests=7, context_length=96, overlap_schedule=overlap)
        engine.spec_worker.policy = CyclingSteps()
        copy_target_into_mtp(engine)
        if overlap:
            step = _install_decode_graph(engine, engine.drafter.mtp.cache, max_draft_tokens=3)
        outs.append(run(engine, requests(engine)))
        caches.append(engine.drafter.mtp.cache.k[0])
    assert step.calls > 0 and torch.equal(caches[0], caches[1])
    a, b = outs
    for rid in a:
        assert b[rid].output_ids == a[rid].output_ids, rid
        assert (b[rid].spec_verify_ct, b[rid].spec_accept_token_num) == \
            (a[rid].spec_verify_ct, a[rid].spec_accept_token_num), rid
