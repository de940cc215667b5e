"""History drafting in the embedded engine (drafters/history.py, ngram.py, hybrid.py): the suffix automaton,
the shared NGRAM cache, rollout-history corpora, and MTP + history drafting; lossless greedy and target-distributed
sampling, as tests/test_engine_drafters.py checks the other drafters."""

import pytest
import torch

from slime_spec.engine.drafters.history import SEPARATOR, HistoryRef, SuffixAutomaton, best_draft
from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.engine.model_executor.sampling import chi_square_pvalue
from tests.helpers.spec_runs import PROMPTS, exact_marginals, generate, make_requests, make_spec_checkpoints, ngram


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return make_spec_checkpoints(tmp_path_factory.mktemp("spec_models"))


def _brute_match(text, context, max_depth):
    """The longest suffix of context[-max_depth:] whose earliest occurrence in text is followed by a token."""
    ctx = context[-max_depth:]
    for n in range(len(ctx), 0, -1):
        ends = [e for e in range(n - 1, len(text)) if text[e - n + 1:e + 1] == ctx[-n:]]
        if ends and ends[0] + 1 < len(text) and text[ends[0] + 1] != SEPARATOR:
            return n
    return 0


def test_suffix_automaton_finds_the_longest_continued_suffix():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        text = torch.randint(0, 4, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        if trial % 3 == 0:
            text[len(text) // 2] = SEPARATOR
        context = torch.randint(0, 4, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        sam = SuffixAutomaton(text)
        length, end = sam.match(context, 8)
        assert length == _brute_match(text, context, 8), (text, context)
        if length:
            assert text[end - length + 1:end + 1] == context[-length:]
    sam = SuffixAutomaton([1, 2, 3, 4, SEPARATOR, 9, 2, 3, 7, 8])
    assert best_draft([5, 2, 3], [sam], 3, 8) == (2, [4])  # stops at the separator, re-match finds nothing
    assert best_draft([9, 2, 3], [sam], 3, 8) == (3, [7, 8])


def _history_requests(tok, temps, corpus_id=None):
    """Two GRPO-like groups (same prompt, n samples each) plus loners without the extension."""
    reqs = []
    for g, text in enumerate(["the cat sat on the mat. the cat", "1 2 3 4 5 6 7 8 1 2 3"]):
        for i in range(4):
            params = SamplingParams(temperature=temps[i % len(temps)], max_new_tokens=12 + 3 * i, ignore_eos=True)
            reqs.append(Request(f"g{g}_{i}", tok(text)["input_ids"], params,
                                history=HistoryRef(group=f"group{g}", corpus_id=corpus_id)))
    for i, text in enumerate(PROMPTS[:4]):
        reqs.append(Request(f"solo{i}", tok(text)["input_ids"], SamplingParams(temperature=0.0, max_new_tokens=10)))
    return reqs


def test_history_drafting_is_lossless_for_greedy_rows(ckpts):
    path = str(ckpts["llama"])
    base_engine = EngineCore(path, None, max_running_requests=4)
    tok = base_engine.tokenizer
    base = generate(base_engine, _history_requests(tok, [0.0]))
    engine = EngineCore(path, ngram(4), max_running_requests=4)
    # Last epoch's answers to group 0 become its corpus; group 1 names a corpus that does not exist.
    engine.drafter.add_corpus("prev", [base["g0_3"].output_ids, [SEPARATOR], base["g0_1"].output_ids])
    reqs = _history_requests(tok, [0.0, 0.0, 0.9], corpus_id="prev")
    outs = generate(engine, reqs, join_every=3)
    for rid, o in base.items():
        if not rid.endswith("_2"):  # the sampled rows
            assert o.output_ids == outs[rid].output_ids, rid
            assert o.finish_reason == outs[rid].finish_reason
    g0 = [outs[f"g0_{i}"] for i in (0, 1, 3)]
    assert sum(o.spec_accept_token_num for o in g0) > 0.5 * sum(o.spec_draft_token_num for o in g0)
    assert engine.drafter.list_corpora() == {"prev": len(base["g0_3"].output_ids) + len(base["g0_1"].output_ids) + 1}


def test_history_drafting_sampling_follows_the_target_distribution(ckpts):
    prompt, temperature, n = [5, 6, 7, 5, 6], 1.3, 3000
    path = str(ckpts["v16"])
    engine = EngineCore(path, ngram(3), max_running_requests=64, seed=0)
    engine.drafter.add_corpus("hist", [[5, 6, 7, 5, 6, 7, 5, 6, 7, 1, 2]])
    params = SamplingParams(temperature=temperature, max_new_tokens=3, ignore_eos=True)
    for i in range(n):
        engine.add_request(Request(str(i), prompt, params, history=HistoryRef(group=f"g{i // 8}", corpus_id="hist")))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert sum(o.spec_accept_token_num for o in outs) > 0.05 * n
    assert sum(o.spec_accept_token_num for o in outs) < sum(o.spec_draft_token_num for o in outs)
    p2, p3 = exact_marginals(path, prompt, temperature)
    t2 = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=16)
    t3 = torch.bincount(torch.tensor([o.output_ids[2] for o in outs]), minlength=16)
    assert chi_square_pvalue(t2, p2) > 1e-3
    assert chi_square_pvalue(t3, p3) > 1e-3


def test_siblings_in_flight_draft_from_each_other(ckpts):
    """A late sibling copies what its running sibling already produced: near-full acceptance, greedy."""
    path = str(ckpts["llama"])
    engine = EngineCore(path, ngram(4), max_running_requests=4)
    ids = engine.tokenizer("mixing it up here")["input_ids"]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    engine.add_request(Request("first", ids, params, history=HistoryRef(group="g")))
    for _ in range(12):
        engine.step()
    engine.add_request(Request("second", ids, params, history=HistoryRef(group="g")))
    outs = {}
    while engine.has_work():
        outs.update({o.rid: o for o in engine.step()})
    assert outs["second"].output_ids == outs["first"].output_ids
    assert outs["second"].spec_verify_ct < outs["first"].spec_verify_ct
    assert outs["second"].spec_accept_token_num >= 0.8 * outs["second"].spec_draft_token_num


def test_external_corpus_ids_are_unique_and_empty_corpora_refused(ckpts):
    engine = EngineCore(str(ckpts["llama"]), ngram(3))
    assert engine.drafter.add_corpus("a", [[1, 2], [3]]) == 3
    with pytest.raises(ValueError, match="already exists"):
        engine.drafter.add_corpus("a", [[4]])
    with pytest.raises(ValueError, match="empty"):
        engine.drafter.add_corpus("b", [])
    engine.drafter.remove_corpus("a")
    assert engine.drafter.list_corpora() == {}


def test_streaming_match_follows_a_growing_automaton():
    """SuffixAutomaton.step keeps a match valid while the automaton grows (clones included): every match it
    reports is a real occurrence, never longer than a from-scratch brute force finds; over a text that no longer
    grows it finds exactly what the brute force finds."""
    g = torch.Generator().manual_seed(1)
    rand = lambda high, n: torch.randint(0, high, (n,), generator=g).tolist()  # noqa: E731
    for _ in range(60):
        sam, state, length, context = SuffixAutomaton(), 0, 0, []
        for _ in range(40):
            if rand(2, 1)[0]:
                sam.extend(rand(3, rand(3, 1)[0] + 1))
            else:
                context.append(rand(3, 1)[0])
                state, length = sam.step(state, length, context[-1])
            found, end = sam.occurrence(state, length)
            assert found <= _brute_match(sam.text, context, len(context) or 1), (sam.text, context)
            if found:
                assert sam.text[end - found + 1:end + 1] == context[-found:]
        state, length, context = 0, 0, []
        for t in rand(3, 20):
            context.append(t)
            state, length = sam.step(state, length, t)
            assert sam.occurrence(state, length)[0] == _brute_match(sam.text, context, len(context))


def test_ngram_cache_finds_the_longest_suffix_seen_before():
    """The rolling-hash n-gram cache against a brute force over every token list it indexed."""
    from slime_spec.engine.drafters.ngram import NgramDrafter
    class Row:  # what the drafter reads of request.Row
        def __init__(self, tokens):
            self.tokens, self.ngram_upto, self.draft_state = tokens, 1, {}

    g = torch.Generator().manual_seed(2)
    drafter = NgramDrafter(num_steps=4, max_window=6, min_window=1, device="cpu")
    rows = [Row(torch.randint(0, 3, (5,), generator=g).tolist()) for _ in range(3)]
    for _ in range(30):
        for r in rows:
            r.tokens += torch.randint(0, 3, (int(torch.randint(1, 3, (1,), generator=g)),), generator=g).tolist()
        drafter.on_prefill(rows, None)
        for r in rows:
            ctx = r.tokens
            expect = 0
            for w in range(min(6, len(ctx)), 0, -1):
                if any(s.tokens[e - w:e] == ctx[-w:] for s in rows for e in range(w, len(s.tokens))):
                    expect = w
                    break
            length, found = drafter.match(r)
            assert length == expect
            assert (found != []) == (expect > 0)


def _hybrid_requests(tok, temps, corpus_id=None):
    reqs = _history_requests(tok, temps, corpus_id)
    for r in reqs[-2:]:
        r.history = None
    return reqs


@pytest.mark.parametrize("draft_sampling", [False, True])
def test_hybrid_mtp_and_history_is_lossless_for_greedy_rows(ckpts, draft_sampling):
    """NEXTN with `slime_history` requests: history and MTP rows mixed in one batch, greedy rows equal plain."""
    from slime_spec.engine.drafters import HybridDrafter
    path = str(ckpts["mimo"])
    base_engine = EngineCore(path, None, max_running_requests=4)
    tok = base_engine.tokenizer
    base = generate(base_engine, _hybrid_requests(tok, [0.0]))
    engine = EngineCore(path, SpecConfig("NEXTN", 3, 1, 4), max_running_requests=4, draft_sampling=draft_sampling)
    assert isinstance(engine.drafter, HybridDrafter)
    engine.drafter.add_corpus("prev", [base["g0_3"].output_ids, [SEPARATOR], base["g1_2"].output_ids])
    outs = generate(engine, _hybrid_requests(tok, [0.0, 0.0, 0.9], corpus_id="prev"), join_every=3)
    for rid, o in base.items():
        if not rid.endswith("_2"):
            assert o.output_ids == outs[rid].output_ids, rid
            assert o.finish_reason == outs[rid].finish_reason
    assert engine.drafter.history_rows > 0 and engine.drafter.mtp_rows > 0
    g0 = [outs[f"g0_{i}"] for i in (0, 1, 3)]
    assert sum(o.spec_accept_token_num for o in g0) > 0.5 * sum(o.spec_draft_token_num for o in g0)


def test_hybrid_without_the_extension_drafts_exactly_as_mtp(ckpts):
    """No `slime_history` on any request: the hybrid is the MTP drafter (same drafts, same acceptance)."""
    spec = SpecConfig("NEXTN", 3, 1, 4)
    engine = EngineCore(str(ckpts["mimo"]), spec, max_running_requests=4)
    outs = generate(engine, make_requests(engine.tokenizer))
    assert engine.drafter.history_rows == 0
    from slime_spec.engine.drafters import MTPDrafter
    plain_mtp = EngineCore(str(ckpts["mimo"]), spec, max_running_requests=4)
    plain_mtp.spec_worker.drafter = MTPDrafter(plain_mtp.model, 3, 5, plain_mtp.max_seq)
    ref = generate(plain_mtp, make_requests(plain_mtp.tokenizer))
    assert [outs[r].spec_accept_token_num for r in ref] == [ref[r].spec_accept_token_num for r in ref]


@pytest.mark.parametrize("draft_sampling", [False, True])
def test_hybrid_sampling_follows_the_target_distribution(ckpts, draft_sampling):
    prompt, temperature, n = [5, 6, 7, 5, 6], 1.3, 3000
    path = str(ckpts["v16_mimo"])
    engine = EngineCore(path, SpecConfig("EAGLE", 2, 1, 3), max_running_requests=64, seed=0,
                        draft_sampling=draft_sampling)
    engine.drafter.add_corpus("hist", [[5, 6, 7, 5, 6, 7, 5, 6, 7, 1, 2]])
    params = SamplingParams(temperature=temperature, max_new_tokens=3, ignore_eos=True)
    for i in range(n):  # every other request drafts with MTP only
        ref = HistoryRef(group=f"g{i // 8}", corpus_id="hist") if i % 2 else None
        engine.add_request(Request(str(i), prompt, params, history=ref))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert engine.drafter.history_rows > 0 and engine.drafter.mtp_rows > 0
    assert sum(o.spec_accept_token_num for o in outs) > 0.05 * n
    assert sum(o.spec_accept_token_num for o in outs) < sum(o.spec_draft_token_num for o in outs)
    p2, p3 = exact_marginals(path, prompt, temperature)
    t2 = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=16)
    t3 = torch.bincount(torch.tensor([o.output_ids[2] for o in outs]), minlength=16)
    assert chi_square_pvalue(t2, p2) > 1e-3
    assert chi_square_pvalue(t3, p3) > 1e-3
