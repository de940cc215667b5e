"""Speculative decoding in the embedded engine: lossless greedy, target-distributed sampling, MTP wiring."""

import dataclasses

import pytest
import torch

from slime_spec.engine.managers.engine_core import EngineCore, Request, SamplingParams, SpecConfig
from slime_spec.engine.model_executor.model import load_model
from slime_spec.engine.model_executor.sampling import chi_square_pvalue
from tests.helpers.engine_runs import DEVICES, assert_logprobs_equal_a_full_forward
from tests.helpers.spec_runs import (
    PROMPTS,
    copy_target_into_mtp,
    exact_marginals,
    generate,
    make_requests,
    make_spec_checkpoints,
    ngram,
)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return make_spec_checkpoints(tmp_path_factory.mktemp("spec_models"))


SPECS = {
    "llama": [SpecConfig("STANDALONE", 3, 1, 4, "{llama}"), SpecConfig("STANDALONE", 2, 1, 3, "{draft}"),
              ngram(5), ngram(2)],
    "mimo": [SpecConfig("NEXTN", 3, 1, 4), SpecConfig("EAGLE", 1, 1, 2), SpecConfig("EAGLE", 4, 1, 5)],
}


def _spec(ckpts, spec):
    if spec is None:
        return None
    path = spec.speculative_draft_model_path
    return dataclasses.replace(spec, speculative_draft_model_path=path.format(**{k: str(v) for k, v in ckpts.items()})
                               if path else None)


@pytest.mark.parametrize("arch", ["llama", "mimo"])
def test_greedy_output_is_identical_with_every_algorithm(ckpts, arch):
    base_engine = EngineCore(str(ckpts[arch]), None, max_running_requests=4)
    tok = base_engine.tokenizer
    base = generate(base_engine, make_requests(tok))
    # Batching itself is invisible: each request alone gives the same tokens.
    for i in (1, 4, 11):
        alone = generate(EngineCore(str(ckpts[arch]), None), [make_requests(tok)[i]])
        assert alone[f"r{i}"].output_ids == base[f"r{i}"].output_ids
    for spec in SPECS[arch]:
        engine = EngineCore(str(ckpts[arch]), _spec(ckpts, spec), max_running_requests=4)
        # Sampled requests share the batch with greedy ones; greedy rows must not notice.
        outs = generate(engine, make_requests(tok, temps=[0.0, 0.0, 0.9]), join_every=3)
        for rid, o in base.items():
            if int(rid[1:]) % 3 != 2:
                assert o.output_ids == outs[rid].output_ids, (spec, rid)
                assert o.finish_reason == outs[rid].finish_reason
        spec_outs = [o for o in outs.values() if o.spec_verify_ct]
        assert spec_outs and all(o.spec_draft_token_num
                                 == o.spec_verify_ct * spec.speculative_num_draft_tokens - o.spec_verify_ct
                                 for o in spec_outs)
        assert 1.0 <= engine.avg_spec_accept_length <= spec.speculative_num_draft_tokens


def test_draft_equal_to_target_accepts_everything(ckpts):
    engine = EngineCore(str(ckpts["llama"]), SpecConfig("STANDALONE", 3, 1, 4, str(ckpts["llama"])),
                        max_running_requests=8)
    outs = generate(engine, make_requests(engine.tokenizer))
    for o in outs.values():
        assert o.spec_accept_token_num == o.spec_draft_token_num == 3 * o.spec_verify_ct
    assert engine.avg_spec_accept_length == 4.0
    # The draft keeps its weights through a release/resume cycle (SGLang PR #31674's failure mode).
    engine.release_memory(["weights", "kv_cache"])
    assert engine.drafter.draft.lm_head.weight.numel() == 0
    engine.resume_memory(["weights", "kv_cache"])
    again = generate(engine, make_requests(engine.tokenizer))
    assert all(o.spec_accept_token_num == 3 * o.spec_verify_ct for o in again.values())


def _reference_mtp_drafts(model, tokens, k):
    """Draft tokens recomputed from scratch: target forward, MTP extend over x_1..x_n, then k-1 chained steps."""
    n = len(tokens) - 1
    ids = torch.tensor([tokens[:n]])
    pos = torch.arange(n)[None]
    hidden = model(ids, pos, model.new_cache(1, n + k + 2), torch.tensor([0]))
    cache = model.new_mtp_cache(1, n + k + 2)
    out = model.mtp_forward(torch.tensor([tokens[1:]]), hidden, pos, cache, torch.tensor([0]))[:, -1]
    drafts = [int(model.logits(out).argmax())]
    for j in range(k - 1):
        out = model.mtp_forward(torch.tensor([[drafts[-1]]]), out[:, None], torch.tensor([[n + j]]), cache,
                                torch.tensor([0]))[:, 0]
        drafts.append(int(model.logits(out).argmax()))
    return drafts


def test_mtp_drafts_match_reference_recurrence(ckpts):
    engine = EngineCore(str(ckpts["mimo"]), SpecConfig("NEXTN", 3, 1, 4), max_running_requests=4)
    copy_target_into_mtp(engine)  # so that acceptance varies and rollback paths run
    checked = []
    propose = engine.drafter.propose

    def recording_propose(rows):
        drafts = propose(rows)
        for r, d in zip(rows, drafts.tolist()):
            if len(checked) < 25 and len(r.tokens) % 3 == 0:
                checked.append((list(r.tokens), d))
        return drafts

    engine.drafter.propose = recording_propose
    outs = generate(engine, make_requests(engine.tokenizer))
    assert len(checked) == 25 and sum(o.spec_accept_token_num for o in outs.values()) > 0
    for tokens, drafts in checked:
        assert drafts == _reference_mtp_drafts(engine.model, tokens, 3), tokens


def test_mtp_only_update_changes_acceptance_not_greedy_output(ckpts):
    spec = SpecConfig("NEXTN", 3, 1, 4)
    before_engine = EngineCore(str(ckpts["mimo"]), spec, max_running_requests=8)
    before = generate(before_engine, make_requests(before_engine.tokenizer))
    engine = EngineCore(str(ckpts["mimo"]), spec, max_running_requests=8)
    target_before = {n: t.clone() for n, t in engine.named_weights("target").items()}
    copy_target_into_mtp(engine)
    assert all(torch.equal(t, engine.named_weights("target")[n]) for n, t in target_before.items())
    after = generate(engine, make_requests(engine.tokenizer))
    assert all(before[r].output_ids == after[r].output_ids for r in before)
    assert before_engine.avg_spec_accept_length < 1.3 < 2.5 < engine.avg_spec_accept_length
    # A release/resume cycle keeps the draft's weights: the same outputs and the same acceptance.
    engine.release_memory(None)
    assert engine.model.model.mtp_layers[0].input_proj.weight.numel() == 0
    engine.resume_memory(None)
    again = generate(engine, make_requests(engine.tokenizer))
    assert all(again[r].output_ids == after[r].output_ids for r in after)
    assert [again[r].spec_accept_token_num for r in after] == [after[r].spec_accept_token_num for r in after]


@pytest.mark.parametrize("temps", [[0.0, 0.7], [0.7]])
@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_under_speculation_equal_a_full_forward(ckpts, device, temps):
    """On CUDA the engine replays CUDA graphs (float32 here: the tolerance is float32's, 1e-3 for GPU kernels); with
    every row sampled it samples and accepts through the sampling kernel."""
    engine = EngineCore(str(ckpts["llama"]), SpecConfig("STANDALONE", 2, 1, 3, str(ckpts["draft"])),
                        max_running_requests=4, seed=3, device=device)
    outs = generate(engine, make_requests(engine.tokenizer, temps=temps, logprob=True))
    requests = make_requests(engine.tokenizer, temps=temps)
    assert_logprobs_equal_a_full_forward(load_model(ckpts["llama"])[0], requests, outs, device)


@pytest.mark.parametrize("target,spec,draft_sampling", [
    ("v16", SpecConfig("STANDALONE", 2, 1, 3, "v16_draft"), False),
    ("v16", SpecConfig("STANDALONE", 2, 1, 3, "v16_draft"), True),
    ("v16", ngram(3), False),
    ("v16_mimo", SpecConfig("EAGLE", 2, 1, 3), False),
    ("v16_mimo", SpecConfig("EAGLE", 2, 1, 3), True),
])
@pytest.mark.parametrize("device", DEVICES)
def test_speculative_sampling_follows_the_target_distribution(ckpts, target, spec, draft_sampling, device):
    """Both drafting modes (SGLang's greedy chain, and ours: drafts sampled from q) emit the plain sampler's tokens
    (on CUDA with the engine's CUDA graphs)."""
    prompt, temperature, n = [5, 6, 7, 5, 6], 1.3, 3000
    path = str(ckpts[target])
    draft = str(ckpts[spec.speculative_draft_model_path]) if spec.speculative_draft_model_path else None
    engine = EngineCore(path, dataclasses.replace(spec, speculative_draft_model_path=draft),
                        max_running_requests=64, seed=0, draft_sampling=draft_sampling, device=device)
    params = SamplingParams(temperature=temperature, max_new_tokens=3, ignore_eos=True)
    for i in range(n):
        engine.add_request(Request(str(i), prompt, params))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert sum(o.spec_accept_token_num for o in outs) > 0.05 * n  # drafts are accepted, and rejected
    assert sum(o.spec_accept_token_num for o in outs) < sum(o.spec_draft_token_num for o in outs)
    p2, p3 = exact_marginals(path, prompt, temperature)
    t2 = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=16)
    t3 = torch.bincount(torch.tensor([o.output_ids[2] for o in outs]), minlength=16)
    assert chi_square_pvalue(t2, p2) > 1e-3
    assert chi_square_pvalue(t3, p3) > 1e-3


@pytest.mark.parametrize("arch", ["llama", "mimo"])
def test_draft_sampling_keeps_greedy_output_and_raises_acceptance(ckpts, arch):
    """Greedy requests are untouched by draft sampling; sampled ones accept more with drafts sampled from q."""
    base_engine = EngineCore(str(ckpts[arch]), None, max_running_requests=4)
    base = generate(base_engine, make_requests(base_engine.tokenizer))
    spec = SpecConfig("STANDALONE", 3, 1, 4, str(ckpts["llama"])) if arch == "llama" else SpecConfig("EAGLE", 3, 1, 4)
    engine = EngineCore(str(ckpts[arch]), spec, max_running_requests=4, draft_sampling=True)
    outs = generate(engine, make_requests(engine.tokenizer, temps=[0.0, 0.0, 0.9]), join_every=3)
    for rid, o in base.items():
        if int(rid[1:]) % 3 != 2:
            assert o.output_ids == outs[rid].output_ids, rid


def test_draft_sampling_with_the_target_as_draft_accepts_every_sampled_token(ckpts):
    """q == p exactly: min(1, p/q) = 1, so every sampled draft is accepted (greedy drafting would reject most)."""
    spec = SpecConfig("STANDALONE", 3, 1, 4, str(ckpts["llama"]))
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    accepted = {}
    for mode in (False, True):
        engine = EngineCore(str(ckpts["llama"]), spec, max_running_requests=8, seed=1, draft_sampling=mode)
        outs = generate(engine, [Request(f"s{i}", engine.tokenizer(t)["input_ids"], params)
                                 for i, t in enumerate(PROMPTS[:8])], first_wave=8)
        accepted[mode] = sum(o.spec_accept_token_num for o in outs.values()) / \
            sum(o.spec_draft_token_num for o in outs.values())
    assert accepted[True] == 1.0 and accepted[False] < 0.5, accepted


def test_draft_sampling_is_refused_where_it_cannot_apply(ckpts):
    with pytest.raises(ValueError, match="--spec-draft-sampling needs speculative decoding"):
        EngineCore(str(ckpts["llama"]), None, draft_sampling=True)
    with pytest.raises(ValueError, match="only chain drafters"):
        EngineCore(str(ckpts["llama"]), ngram(3), draft_sampling=True)


def test_unsupported_algorithms_are_rejected_with_the_backend_code(ckpts):
    with pytest.raises(ValueError, match="^SPEC_TOPK_TOKENS:.*at most 7 nodes"):  # SGLang's tree-size limit
        EngineCore(str(ckpts["mimo"]), SpecConfig("EAGLE", 2, 2, 8))
    with pytest.raises(ValueError, match="EAGLE3.*draft-model-path"):
        EngineCore(str(ckpts["mimo"]), SpecConfig("EAGLE3", 3, 1, 4))
    with pytest.raises(ValueError, match="--spec-draft-sampling with --speculative-eagle-topk 4"):
        EngineCore(str(ckpts["mimo"]), SpecConfig("EAGLE", 3, 4, 8), draft_sampling=True)
    with pytest.raises(ValueError, match="num_steps \\+ 1"):
        EngineCore(str(ckpts["mimo"]), SpecConfig("NEXTN", 3, 1, 6))
    with pytest.raises(ValueError, match="MTP layers"):
        EngineCore(str(ckpts["llama"]), SpecConfig("NEXTN", 3, 1, 4))
    with pytest.raises(ValueError, match="draft-model-path"):
        EngineCore(str(ckpts["llama"]), SpecConfig("STANDALONE", 3, 1, 4))
    with pytest.raises(ValueError, match="vocab_size"):
        EngineCore(str(ckpts["llama"]), SpecConfig("STANDALONE", 3, 1, 4, str(ckpts["v16"])))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_for_every_algorithm(ckpts):
    cpu = EngineCore(str(ckpts["llama"]), None, max_running_requests=4)
    base = generate(cpu, make_requests(cpu.tokenizer))
    for arch, specs in (("llama", SPECS["llama"]), ("mimo", SPECS["mimo"])):
        if arch == "mimo":
            cpu = EngineCore(str(ckpts["mimo"]), None, max_running_requests=4)
            base = generate(cpu, make_requests(cpu.tokenizer))
        for spec in [None] + specs:
            engine = EngineCore(str(ckpts[arch]), _spec(ckpts, spec), device="cuda", max_running_requests=4)
            outs = generate(engine, make_requests(engine.tokenizer, logprob=True))
            for rid, o in base.items():
                assert outs[rid].output_ids == o.output_ids, (arch, spec, rid)


def test_deferring_plain_steps_leaves_no_object_per_row_for_the_garbage_collector(ckpts):
    """A plain step's deferred MTP extend is one int per row in its slot's queue: before, each row and step kept a
    tuple and a list alive until the catch-up, and at batch 128 the collector's passes over them cost ms a run."""
    import gc
    from types import SimpleNamespace

    from slime_spec.engine.drafters.mtp import MTPDrafter
    model, _ = load_model(ckpts["mimo"], dtype="float32", device="cpu")
    drafter = MTPDrafter(model, 2, 65, 64)
    rows = [SimpleNamespace(slot=i, tokens=[5, 6, 7]) for i in range(64)]
    drafter.on_prefill(rows, torch.zeros(64, 2, model.args.hidden_size))
    hidden = torch.zeros(64, 1, model.args.hidden_size)
    gc.collect()
    before = len(gc.get_objects())
    for step in range(20):
        drafter.defer(rows, hidden, [2 + step] * 64)
    assert len(gc.get_objects()) - before <= 20 * 8  # a few per step (its entry), none per row (1,280 rows)
    assert [len(q) for q in drafter.pending.values()] == [21] * 64


def test_every_drafter_implements_the_hooks_its_capabilities_declare():
    """The engine calls a hook only where a capability says so (base.Drafter); each declaration has its hook."""
    from slime_spec.engine import drafters
    from slime_spec.engine.drafters.base import Drafter
    classes = [drafters.MTPDrafter, drafters.Eagle3Drafter, drafters.StandaloneDrafter, drafters.NgramDrafter,
               drafters.HistoryDrafter, drafters.HybridDrafter]
    for cls in classes:
        assert issubclass(cls, Drafter) and cls.propose is not Drafter.propose, cls
        if cls.supports_tree:
            assert cls.tree_draft is not Drafter.tree_draft, cls
        if cls.extends_before_read_back:
            assert cls.verify_extend is not Drafter.verify_extend, cls
        if cls.defers_plain_steps:
            assert cls.catch_up_deferred is not Drafter.catch_up_deferred, cls
        if cls.holds_corpora:
            assert all(hasattr(cls, name) for name in ("add_corpus", "remove_corpus", "list_corpora")), cls
        # SGLang's manager asks at every weight request whether the draft has weights: declared, never built
        assert cls.owns_weights == (cls.weight_runner is not Drafter.weight_runner), cls
    with pytest.raises(NotImplementedError, match="chains only"):
        drafters.NgramDrafter(3, 4, 1, "cpu").tree_draft([], None)


def test_num_steps_reaches_the_drafter_under_one_name_resolved_once(ckpts, monkeypatch):
    """--speculative-num-steps: the server's flags -> settings.resolve (SpecConfig.num_steps) -> the step policy's
    max_num_steps -> the drafter's num_steps; resolved once in the engine's process, no drafter renames it."""
    import pickle
    import re
    from pathlib import Path

    from slime_spec.engine import drafters
    from slime_spec.engine.server_args import parse_server_args
    from slime_spec.speculative import settings

    calls = []
    resolve = settings.resolve
    monkeypatch.setattr(settings, "resolve", lambda *a, **kw: calls.append(a) or resolve(*a, **kw))
    args = parse_server_args(["--model-path", str(ckpts["mimo"]), "--speculative-algorithm", "NEXTN",
                              "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                              "--speculative-num-draft-tokens", "4"], cuda_available=False)
    spec = pickle.loads(pickle.dumps(args.spec))  # as the server hands it to its scheduler process
    engine = EngineCore(args.model_path, spec, max_running_requests=2)
    assert len(calls) == 1
    assert args.spec.speculative_num_steps == args.spec.num_steps == engine.policy.max_num_steps == 3
    assert engine.drafter.num_steps == engine.drafter.mtp.num_steps == 3
    for path in Path(drafters.__file__).parent.glob("*.py"):
        assert not re.search(r"\w\.k\b", path.read_text().replace("cache.k", "")), path.name  # KV caches' k
