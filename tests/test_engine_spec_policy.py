"""Draft length per step: the pure choice of --spec-auto, and adaptive / auto speculation in the engine."""

import pytest
import torch

from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams
from slime_spec.engine.speculative.policy import AutoSteps, best_steps, bucket_of, expected_tokens
from slime_spec.speculative.settings import resolve_or_raise
from slime_spec.tools.tiny_model import make_tiny_model


def test_expected_tokens_is_the_truncated_geometric_sum():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_best_steps_trades_tokens_against_cost():
    linear = {k: 1.0 + k for k in range(4)}  # a step costs nearly in proportion to k + 1 (CPU, big batch)
    flat = {k: 1.0 + 0.15 * k for k in range(4)}  # drafting and verifying nearly free per token (small batch)
    chain = {0: 1.0, 1: 2.4, 2: 2.5, 3: 2.6}  # one captured draft chain: dear to start, then nearly flat in k
    assert best_steps(0.9, linear) == 0
    assert best_steps(0.9, flat) == 3
    assert best_steps(0.1, flat) == 0
    assert best_steps(0.6, {k: 1.0 + 0.4 * k for k in range(4)}) == 1
    assert best_steps(0.9, chain) == 3 and best_steps(0.5, chain) == 0
    assert best_steps(0.0, {0: 1.0, 1: 1.0}) == 0  # ties go to plain decoding


def test_auto_measures_every_k_then_settles_and_keeps_exploring():
    auto = AutoSteps(max_num_steps=3, explore_every=8)
    costs = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}
    seen = []
    for _ in range(64):
        k = auto.choose(4)
        seen.append(k)
        accepted = [k] * 4  # every draft accepted: the longest chain pays
        auto.observe(4, k, accepted, draft_s=0.01 * k, verify_s=costs[k])
    assert seen[:4] == [0, 1, 2, 3] and auto.accept_rate > 0.9
    assert seen[-8:].count(3) >= 7 and 2 in seen[8:]  # settles on 3, and still explores its neighbour
    assert bucket_of(3) == bucket_of(4) == 4 and bucket_of(1) == 1 and bucket_of(5) == 8


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("policy") / "mimo", arch="mimo", hidden_size=32, num_layers=1,
                           seed=13)


def run(engine, n=6, max_new=20, temperature=0.0):
    tok = engine.tokenizer
    for i in range(n):
        engine.add_request(Request(f"r{i}", tok(f"prompt {i} " * (i + 1))["input_ids"],
                                   SamplingParams(temperature=temperature, max_new_tokens=max_new, ignore_eos=True)))
    outs = {}
    while engine.has_work():
        outs.update({o.rid: o for o in engine.step()})
    return outs


@pytest.mark.parametrize("mode", ["adaptive", "auto"])
def test_adaptive_and_auto_keep_greedy_output_and_vary_k(mimo, mode):
    base = run(EngineCore(str(mimo), None, max_running_requests=6))
    server_args = {"speculative_algorithm": "EAGLE"}
    if mode == "adaptive":
        server_args |= {"speculative_adaptive": True}
    spec = resolve_or_raise(server_args, target_config={"architectures": ["MiMoForCausalLM"],
                                                        "num_nextn_predict_layers": 1})
    engine = EngineCore(str(mimo), spec, max_running_requests=6, spec_auto=mode == "auto")
    chosen = []
    choose = engine.policy.choose
    engine.policy.choose = lambda bs: chosen.append(choose(bs)) or chosen[-1]
    outs = run(engine)
    assert {r: o.output_ids for r, o in outs.items()} == {r: o.output_ids for r, o in base.items()}
    assert len(set(chosen)) > 1, chosen  # the draft length moved (0 = plain steps included for auto)
    times = engine.step_times  # every phase of the speculative steps was timed, plain (k = 0) steps apart
    assert times.draft_s > 0 and times.verify_s > 0 and times.sampling_s > 0 and (times.plain_s > 0) == (0 in chosen)
    assert engine.max_seq >= engine.context_length + engine.policy.max_num_steps + 1


@pytest.mark.parametrize("algorithm", ["STANDALONE", "NGRAM"])
def test_auto_keeps_greedy_output_for_standalone_and_ngram(tmp_path, algorithm):
    """Plain (k = 0) steps between speculative ones leave the draft cache behind; it catches up, losslessly."""
    llama = make_tiny_model(tmp_path / "llama", hidden_size=32, num_layers=2, seed=11)
    draft = make_tiny_model(tmp_path / "draft", hidden_size=32, num_layers=1, seed=12, init_from=str(llama))
    base = run(EngineCore(str(llama), None, max_running_requests=6))
    server_args = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 4}
    if algorithm == "STANDALONE":
        server_args = {"speculative_algorithm": algorithm, "speculative_draft_model_path": str(draft),
                       "speculative_num_steps": 3, "speculative_eagle_topk": 1}
    spec = resolve_or_raise(server_args, target_config={"architectures": ["LlamaForCausalLM"]})
    engine = EngineCore(str(llama), spec, max_running_requests=6, spec_auto=True)
    engine.policy.explore_every = 3
    outs = run(engine)
    assert {r: o.output_ids for r, o in outs.items()} == {r: o.output_ids for r, o in base.items()}


class ScriptedSteps:
    """A step policy that plays a fixed sequence of draft lengths (then repeats the last)."""

    def __init__(self, ks: list[int]):
        self.ks, self.max_num_steps, self.i = ks, max(ks), 0

    def choose(self, batch_size: int) -> int:
        self.i += 1
        return self.ks[min(self.i - 1, len(self.ks) - 1)]

    def observe(self, batch_size, k, accepted, draft_s, verify_s, switch_s=0.0) -> None:
        return None


def test_mtp_catch_up_after_plain_steps_equals_an_extend_over_the_whole_sequence(mimo):
    """k = 0 steps defer the MTP extend; the batched catch-up leaves the MTP layer where one extend over every
    committed token (the target's hidden states from one full forward) leaves it."""
    spec = resolve_or_raise({"speculative_algorithm": "EAGLE", "speculative_num_steps": 2,
                             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3},
                            target_config={"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1})
    engine = EngineCore(str(mimo), spec, max_running_requests=3)
    engine.spec_worker.policy = ScriptedSteps([2, 0, 0, 0, 2, 0, 0])
    drafter = engine.drafter.mtp  # NEXTN/EAGLE: the MTP drafter inside the history hybrid
    tok = engine.tokenizer
    for i in range(3):
        engine.add_request(Request(f"r{i}", tok(f"q {i} " * (i + 2))["input_ids"],
                                   SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)))
    for _ in range(7):
        engine.step()
    assert drafter.pending and all(len(q) == 2 for q in drafter.pending.values())  # two plain steps deferred
    rows = list(engine.running)
    assert drafter.catch_up_deferred(rows)
    assert not drafter.pending
    assert not drafter.catch_up_deferred(rows)  # nothing left: nothing runs (SpecWorker.catch_up then skips its sync)
    for r in rows:
        assert_as_one_extend(engine, drafter, r)


def test_a_catch_up_of_rows_admitted_apart_gathers_each_rows_own_hidden_states(mimo):
    """The catch-up gathers hidden states from one table of every waiting step's: rows prefilled in different steps
    (so a row's index differs between its prefill and the plain steps), caught up in two calls, a subset first, in
    another order than the steps held them, each end where one extend over its whole sequence ends."""
    spec = resolve_or_raise({"speculative_algorithm": "EAGLE", "speculative_num_steps": 2,
                             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3},
                            target_config={"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1})
    engine = EngineCore(str(mimo), spec, max_running_requests=3)
    engine.spec_worker.policy = ScriptedSteps([0])
    drafter, tok = engine.drafter.mtp, engine.tokenizer
    for i in range(3):
        engine.add_request(Request(f"r{i}", tok(f"w{i} " * (2 * i + 3))["input_ids"],
                                   SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)))
        for _ in range(i + 1):
            engine.step()
    rows = list(engine.running)
    assert [len(drafter.pending[r.slot]) for r in rows] == [7, 6, 4]  # a prefill, then one segment a plain step
    assert drafter.catch_up_deferred([rows[2], rows[0]])
    assert list(drafter.pending) == [rows[1].slot] and drafter.pending_steps  # rows[1]'s steps are kept
    assert drafter.catch_up_deferred([rows[1]]) and not drafter.pending_steps
    for r in rows:
        assert_as_one_extend(engine, drafter, r)


def assert_as_one_extend(engine, drafter, row):
    """The drafter's next hidden state and MTP cache for `row` equal a fresh MTP layer's after one extend over the
    row's whole committed sequence (MTP positions 0..n-1 read committed tokens 1..n)."""
    from slime_spec.engine.drafters.mtp import MTPDrafter
    fresh = MTPDrafter(engine.model, engine.max_running_requests + 1, 3, engine.max_seq)
    ids = torch.tensor([row.tokens])
    hidden = engine.model(ids, torch.arange(len(row.tokens))[None], engine.model.new_cache(1, engine.max_seq),
                          torch.tensor([0]))
    fresh.on_prefill([row], hidden)  # queued, as every prefill's extend is: run it as one catch-up
    fresh.catch_up_deferred([row])
    torch.testing.assert_close(drafter.next_hidden[row.slot], fresh.next_hidden[row.slot], atol=1e-4, rtol=1e-4)
    n = len(row.tokens) - 1
    torch.testing.assert_close(drafter.cache.k[0][row.slot, :n], fresh.cache.k[0][row.slot, :n], atol=1e-4, rtol=1e-4)


def test_the_extend_queued_before_the_read_back_leaves_the_mtp_layer_where_a_whole_extend_does(mimo):
    """After each verify the MTP extend is launched from the verify's device tensors before the read-back
    (MTPDrafter.verify_extend): over all k + 1 positions, the rejected drafts past the accepted ones included. With
    drafts scripted to be accepted in part (the first one or two right, the next wrong), the next hidden state and
    the cache at every committed position equal one extend over the whole committed sequence after every step: the
    accepted count picks the right output, and the rejected drafts' keys never survive to be read."""
    spec = resolve_or_raise({"speculative_algorithm": "EAGLE", "speculative_num_steps": 3,
                             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4},
                            target_config={"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1})
    plain, engine = EngineCore(str(mimo), None, max_running_requests=3), EngineCore(str(mimo), spec,
                                                                                   max_running_requests=3)
    engine.spec_worker.policy = ScriptedSteps([3])
    truth = {rid: out.output_ids for rid, out in run(plain, n=3, max_new=40).items()}
    real_draft, vocab = engine.drafter.sample_draft, engine.model.lm_head.weight.shape[0]

    def partly_right(rows, pick):  # the MTP layer drafts as usual; then the tokens are replaced
        tokens, q = real_draft(rows, pick)
        tokens = tokens.clone()
        for i, r in enumerate(rows):
            done = len(r.tokens) - len(r.req.input_ids)
            right = 1 + (len(r.tokens) % 2)  # one or two drafts right, then a wrong one
            future = truth[r.req.rid][done: done + 3] + [0] * 3
            tokens[i] = torch.tensor(future[:right] + [(future[right] + 1) % vocab] * (3 - right))
        return tokens, q

    engine.drafter.sample_draft = partly_right
    drafter = engine.drafter.mtp
    for i in range(3):  # the requests `run` gave the plain engine
        engine.add_request(Request(f"r{i}", engine.tokenizer(f"prompt {i} " * (i + 1))["input_ids"],
                                   SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)))
    outs = {}
    for _ in range(12):
        outs.update({o.rid: o for o in engine.step()})
        for r in engine.running:
            if r.verify_ct:
                assert_as_one_extend(engine, drafter, r)
    accepted = engine.spec_worker.accept_tokens - engine.spec_worker.verify_passes
    assert 0 < accepted < 3 * engine.spec_worker.verify_passes  # drafts accepted in part


def test_a_request_that_never_drafts_never_runs_the_mtp_layer(mimo):
    """The prefill's MTP extend waits with the plain steps' (MTPDrafter.on_prefill): under auto or adaptive
    speculation at k = 0 the draft costs nothing, the prompt included; the first draft runs it in its catch-up."""
    spec = resolve_or_raise({"speculative_algorithm": "EAGLE", "speculative_num_steps": 2,
                             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3},
                            target_config={"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1})
    engine = EngineCore(str(mimo), spec, max_running_requests=2)
    engine.spec_worker.policy = ScriptedSteps([0])
    calls = []
    original = engine.model.mtp_forward
    engine.model.mtp_forward = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    engine.add_request(Request("r", engine.tokenizer("1+2=")["input_ids"],
                               SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    assert calls == []
    engine.spec_worker.policy = ScriptedSteps([2])
    engine.add_request(Request("s", engine.tokenizer("1+2=")["input_ids"],
                               SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)))
    engine.step()  # prefill, then a draft: the catch-up runs the prompt's extend first
    assert calls and not engine.drafter.mtp.pending


def test_auto_is_not_fooled_by_one_slow_sample():
    """A noisy machine only adds time: one slow first plain step (cold call, another process) must not keep auto
    drafting when drafts are never accepted."""
    auto = AutoSteps(max_num_steps=2, explore_every=1000)
    costs = {0: 1.0, 1: 1.3, 2: 1.6}
    seen = []
    for step in range(20):
        k = auto.choose(8)
        seen.append(k)
        auto.observe(8, k, [0] * 8, draft_s=0.3 * k, verify_s=100.0 if step == 0 else costs[k])
    # k = 2 is measured once, while one rejection is all the evidence (AutoSteps.planning_rate leans towards
    # drafting); the second pass skips it: with every draft rejected it cannot win even at k = 1's cost (_dominated)
    assert seen[:5] == [0, 1, 2, 0, 1] and set(seen[5:]) == {0}


def test_auto_explores_less_while_the_best_k_holds():
    auto = AutoSteps(max_num_steps=2, explore_every=8, max_explore_every=64)
    seen = []
    for _ in range(400):
        k = auto.choose(8)
        seen.append(k)
        auto.observe(8, k, [0] * 8, draft_s=0.3 * k, verify_s={0: 1.0, 1: 1.3, 2: 1.6}[k])
    probes = [i for i, k in enumerate(seen) if i >= 6 and k != 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert min(gaps) >= 16 and gaps[-3:] == [64] * 3 and len(probes) <= 10  # backs off to 64, never stops


def test_auto_skips_long_drafts_that_cannot_win_but_measures_those_that_can():
    never = AutoSteps(max_num_steps=3, explore_every=1000)
    always = AutoSteps(max_num_steps=3, explore_every=1000)
    costs = {0: 1.0, 1: 1.2, 2: 1.3, 3: 1.4}
    for auto, hit in ((never, 0), (always, 1)):
        seen = []
        for _ in range(12):
            k = auto.choose(8)
            seen.append(k)
            auto.observe(8, k, [k * hit] * 8, draft_s=0.05 * k, verify_s=costs[k])
        if hit:
            assert seen[:4] == [0, 1, 2, 3] and seen[-1] == 3
        else:
            assert 2 not in seen and 3 not in seen and seen[-1] == 0 and never.accept_rate < 0.1


def simulate(auto: AutoSteps, steps: int, hit, costs: dict, draft_s: float, catch_up_s: float, batch: int = 32,
             response_len: int = 128):
    """Drive a policy with scripted costs: each draft accepted iff hit(step); the first draft after plain steps pays
    a catch-up of catch_up_s per plain step since the last draft (MTP's deferred extends), at most a response's
    length of them (a request that finishes takes its deferred positions with it). Returns (k per step, seconds
    per step)."""
    ks, seconds, deferred = [], [], 0
    for step in range(steps):
        k = auto.choose(batch)
        switch = catch_up_s * min(deferred, response_len) if k else 0.0
        deferred = 0 if k else deferred + 1
        accepted = [k if hit(step) else 0] * batch
        auto.observe(batch, k, accepted, draft_s=draft_s * k, verify_s=costs[k], switch_s=switch)
        ks.append(k)
        seconds.append(draft_s * k + costs[k] + switch)
    return ks, seconds


def test_auto_bounds_what_probes_cost_when_drafts_never_pay():
    """A draft that is never accepted, a verify that costs nearly in proportion to its tokens (CPU, large batch)
    and a catch-up of 0.15 plain steps per deferred plain step: after the warm-up, probes cost at most the
    explore budget of the time, and are at most one step in explore_every."""
    auto = AutoSteps(max_num_steps=3)
    costs = {0: 1.0, 1: 1.9, 2: 2.8, 3: 3.7}
    ks, seconds = simulate(auto, 20000, lambda step: False, costs, draft_s=0.3, catch_up_s=0.15)
    warm = 8
    probes = [i for i in range(warm, len(ks)) if ks[i]]
    assert probes and len(probes) <= (len(ks) - warm) / auto.explore_every
    beyond_plain = sum(seconds[warm:]) / (len(ks) - warm) - costs[0]
    assert beyond_plain <= auto.explore_budget * 1.05, beyond_plain
    b = auto.buckets[32]
    assert b.explore_s <= auto.explore_budget * b.total_s + max(seconds)  # one probe may overshoot, then waits
    late = [b - a for a, b in zip(probes, probes[1:])][-3:]
    assert min(late) >= auto.max_explore_every  # rarer as the evidence holds


def test_auto_keeps_the_catch_up_out_of_the_draft_cost():
    """A catch-up is the price of leaving k = 0, not of drafting: it counts in the bucket's time, not in the
    step's cost estimate."""
    auto = AutoSteps(max_num_steps=3)
    auto.observe(4, 0, [0] * 4, draft_s=0.0, verify_s=1.0)
    auto.observe(4, 2, [2] * 4, draft_s=0.1, verify_s=1.1, switch_s=30.0)
    b = auto.buckets[4]
    assert b.step_cost == pytest.approx({0: 1.0, 2: 1.2})
    assert b.total_s == pytest.approx(32.2)


def test_auto_comes_back_to_drafting_when_drafts_start_paying():
    auto = AutoSteps(max_num_steps=3)
    costs = {0: 1.0, 1: 1.05, 2: 1.1, 3: 1.15}
    ks, _ = simulate(auto, 6000, lambda step: step >= 3000, costs, draft_s=0.05, catch_up_s=0.15, batch=4)
    assert set(ks[100:3000]) <= {0, 1} and ks[100:3000].count(0) > 0.95 * 2900
    back = next(i for i in range(3000, 6000) if ks[i] == 3)
    assert back - 3000 <= 2 * auto.max_explore_every  # the next probe sees the hits, with the budget allowing it
    assert ks[-100:].count(3) >= 95


def test_a_new_bucket_starts_from_its_warmed_neighbour_instead_of_measuring_every_k():
    """A rollout's batch shrinks through every bucket as its requests finish. The first bucket measures each k
    twice; the next ones start from its estimates, scaled by their own measurements, and draft at the best k from
    their first step. Their own costs still decide once measured: where a verify of more tokens is dear (a large
    batch on CPU) the borrowed shape is corrected by the bucket's own samples."""
    auto = AutoSteps(max_num_steps=3, explore_every=8)
    cheap = {0: 1.0, 1: 1.05, 2: 1.1, 3: 1.15}
    ks, _ = simulate(auto, 40, lambda step: True, cheap, draft_s=0.05, catch_up_s=0.0, batch=32)
    assert ks[:4] == [0, 1, 2, 3] and ks[-1] == 3
    for batch, scale in ((16, 0.6), (8, 0.4), (4, 0.3)):
        ks, _ = simulate(auto, 3, lambda step: True, {k: c * scale for k, c in cheap.items()}, draft_s=0.05 * scale,
                         catch_up_s=0.0, batch=batch)
        assert ks == [3, 3, 3], (batch, ks)  # no warm-up of k = 0, 1, 2
        assert not auto.buckets[batch].measured_all
    dear = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}  # at 64 rows every verified token costs a step: drafting never pays
    ks, _ = simulate(auto, 400, lambda step: step % 2 == 0, dear, draft_s=0.3, catch_up_s=0.0, batch=64)
    assert ks[0] == 3 and ks[-50:].count(0) >= 45


def test_auto_charges_a_probe_when_its_own_step_is_observed():
    """Under the overlap schedule a speculative step first observes the plain step it reads back (k = 0): a probe
    of k = 1 chosen for that step is still charged to the probe budget when the probe itself is observed."""
    auto = AutoSteps(max_num_steps=1, explore_every=4)
    for _ in range(8):  # warm-up and settling: plain steps win (drafts never accepted)
        k = auto.choose(4)
        auto.observe(4, k, [0] * 4, draft_s=0.5 * k, verify_s={0: 1.0, 1: 1.5}[k])
    b = auto.buckets[4]
    while (k := auto.choose(4)) == 0:
        auto.observe(4, 0, [0] * 4, draft_s=0.0, verify_s=1.0)
    spent = b.explore_s
    auto.observe(4, 0, [0] * 4, draft_s=0.0, verify_s=1.0)  # the plain step in flight, read back by the probe
    auto.observe(4, 1, [0] * 4, draft_s=0.5, verify_s=1.5)  # the probe: 2 s where the best k costs 1 s
    assert b.explore_s == pytest.approx(spent + 1.0) and b.probing is None


def test_adaptive_acceptance_moves_only_with_drafting_steps():
    """A plain step observed after the tier moved to k > 0 (read back by the first speculative step under the
    overlap schedule) counts as a batch, not as zero accepted drafts."""
    from slime_spec.engine.speculative.policy import AdaptiveSteps
    adaptive = AdaptiveSteps(3)
    tier = adaptive.tier(1)
    ema, batches = tier.ema, tier.batches
    adaptive.observe(1, 0, [0], 0.0, 0.0)
    assert tier.current == 3 and tier.ema == ema and tier.batches == batches + 1
    adaptive.observe(1, 3, [1], 0.0, 0.0)
    assert tier.ema < ema


def test_a_one_row_tail_of_bad_luck_does_not_send_the_next_full_batch_to_plain_steps():
    """A rollout drafts at 32 rows, three rows in four accepting every draft, then its last request drafts alone
    and is rejected 30 times in a row. The rate is evidence per row: those 30 drafts weigh little against the
    full batches' evidence, so the next rollout's full batch drafts at once. (Decayed per step, the one-row tail
    wiped the full batches' evidence, the rate fell to 0.24 and the next full batch ran plain until a probe: the
    demo's rollouts with 30-40% of their engine time in plain steps.)"""
    auto = AutoSteps(max_num_steps=3, explore_every=1000)
    costs = {0: 5.0, 1: 6.0, 2: 7.0, 3: 8.0}

    def step(batch: int, hit) -> int:
        k = auto.choose(batch)
        auto.observe(batch, k, [k if hit(row) else 0 for row in range(batch)], draft_s=0.2 * k, verify_s=costs[k])
        return k

    ks = [step(32, lambda row: row % 4 != 0) for _ in range(60)]
    assert ks[-10:] == [3] * 10
    tail = [step(1, lambda row: False) for _ in range(30)]
    assert auto.accept_rate > 0.6, auto.accept_rate
    assert step(32, lambda row: row % 4 != 0) == 3 and tail[0] == 3


def test_auto_reaches_a_long_draft_the_warm_up_skipped_once_acceptance_says_it_can_win():
    """The GPU case after the engine's kernels made its plain step cheap: one draft barely pays (k = 1 ties plain)
    while three pay well (verify cost nearly flat in tokens). The warm-up's first steps miss; once drafts are
    accepted, the policy must try the long drafts (optimistically costed until measured) and settle on 3, not stay
    between 0 and 1 probing only neighbours."""
    auto = AutoSteps(max_num_steps=3)
    costs = {0: 1.0, 1: 1.9, 2: 2.0, 3: 2.1}
    ks, _ = simulate(auto, 400, lambda step: step >= 2, costs, draft_s=0.05, catch_up_s=0.0, batch=1)
    assert ks[:2] == [0, 1]  # the first draft is rejected
    assert ks[-100:].count(3) >= 95


def test_auto_drafts_a_captured_chain_whose_cost_is_flat_in_k():
    """The GPU case: a draft chain replayed as one captured graph costs about the same for 1 token as for 3, and
    a step with any draft costs over twice a plain one (host time). Each draft is accepted with probability 0.85.
    Costed as k times the k = 1 draft, k = 3 looked worse than plain steps (3.18 tokens for 3.3 s against 1 for
    0.9) and was never measured; measured per k (3.18 tokens for 2.5 s), it wins."""
    import random

    rng = random.Random(0)
    auto = AutoSteps(max_num_steps=3)
    verify = {0: 0.9, 1: 2.0, 2: 2.05, 3: 2.1}
    ks = []
    for _ in range(300):
        k = auto.choose(1)
        accepted = next((j for j in range(k) if rng.random() >= 0.85), k)
        auto.observe(1, k, [accepted], draft_s=0.4 if k else 0.0, verify_s=verify[k])
        ks.append(k)
    assert ks[-100:].count(3) >= 90, auto.describe()


def test_auto_does_not_keep_trying_long_drafts_that_are_never_accepted():
    auto = AutoSteps(max_num_steps=3)
    costs = {0: 1.0, 1: 1.9, 2: 2.0, 3: 2.1}
    ks, _ = simulate(auto, 400, lambda step: False, costs, draft_s=0.05, catch_up_s=0.0, batch=1)
    drafting = [i for i, k in enumerate(ks) if k]
    assert len(drafting) <= 8 and ks[-100:].count(0) >= 95  # the warm-up and a few rarer and rarer probes
    assert [b - a for a, b in zip(drafting, drafting[1:])][-2:] == [64, 128]


def test_auto_probes_around_a_best_k_it_has_not_measured_yet():
    """A best k costed optimistically (not yet measured) with a probe due: the probe is charged against that
    estimate (a KeyError once, seen in an NGRAM run)."""
    auto = AutoSteps(max_num_steps=3, explore_every=1, max_explore_every=1, explore_budget=1.0)
    costs = {0: 1.0, 1: 1.9, 2: 2.0, 3: 2.1}
    ks, _ = simulate(auto, 50, lambda step: step >= 2, costs, draft_s=0.05, catch_up_s=0.0, batch=1)
    assert 3 in ks


def test_auto_describes_its_estimates_per_bucket_and_the_k_it_would_choose():
    from slime_spec.engine.speculative.policy import AutoSteps
    policy = AutoSteps(2)
    verify = {0: 1.0e-3, 1: 1.1e-3, 2: 1.2e-3}
    for _ in range(12):
        k = policy.choose(1)
        policy.observe(1, k, [k], 0.1e-3 * k, verify[k])  # every draft accepted: the longest chain wins
    text = policy.describe()
    assert text.startswith("accept rate 0.9") and "batch <= 1: 12 steps" in text
    assert "step ms by k {0: 1.00, 1: 1.20, 2: 1.40}" in text and text.endswith("best k 2")


def test_each_policy_names_the_draft_lengths_it_may_choose():
    """What the engine captures a greedy draft-chain graph for: every k > 0 a step may ask for."""
    from slime_spec.engine.speculative.policy import AdaptiveSteps, AutoSteps, FixedSteps
    assert FixedSteps(3).draft_lengths() == (3,) and FixedSteps(0).draft_lengths() == ()
    assert AutoSteps(3).draft_lengths() == (1, 2, 3)
    adaptive = AdaptiveSteps(3)
    assert adaptive.draft_lengths() == tuple(sorted({c for t in adaptive.tiers.values() for c in t.candidates} - {0}))
    assert adaptive.max_num_steps in adaptive.draft_lengths()
