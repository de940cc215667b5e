"""Draft length per step: the pure choice of --spec-auto, and adaptive / auto speculation in the engine."""

import pytest

from slime_spec.engine.core import EngineCore, Request, SamplingParams
from slime_spec.engine.spec_policy import AutoSteps, best_steps, bucket_of, expected_tokens
from slime_spec.spec import resolve_or_raise
from slime_spec.tiny_model import make_tiny_model


def test_expected_tokens_is_the_truncated_geometric_sum():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_best_steps_trades_tokens_against_cost():
    linear = {k: 1.0 + 0.9 * k for k in range(4)}  # verifying costs nearly in proportion to k + 1 (CPU, big batch)
    flat = {k: 1.0 + 0.05 * k for k in range(4)}   # verifying is nearly free per token (small batch)
    assert best_steps(0.9, draft_cost=0.1, verify_cost=linear) == 0
    assert best_steps(0.9, draft_cost=0.1, verify_cost=flat) == 3
    assert best_steps(0.1, draft_cost=0.1, verify_cost=flat) == 0
    assert best_steps(0.6, draft_cost=0.3, verify_cost=flat) == 1
    assert best_steps(0.0, draft_cost=0.0, verify_cost={0: 1.0, 1: 1.0}) == 0  # ties go to plain decoding


def test_auto_measures_every_k_then_settles_and_keeps_exploring():
    auto = AutoSteps(max_k=3, explore_every=8)
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
    assert engine.max_seq >= engine.context_length + engine.policy.max_k + 1


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
