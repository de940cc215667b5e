"""Running the embedded EngineCore in tests: drive requests to completion, check logprobs against a full forward."""

from __future__ import annotations

import pytest
import torch

# CPU always; CUDA where the machine has it (the GPU machine runs those).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                               reason="needs a CUDA device (runs on the GPU machine)"))]


def run_to_completion(engine, requests) -> dict:
    """Add every request at once and step the engine until it has no work; the outputs by request id."""
    for r in requests:
        engine.add_request(r)
    outs = {}
    while engine.has_work():
        for o in engine.step():
            outs[o.rid] = o
    return outs


def assert_logprobs_equal_a_full_forward(model, requests, outs, device) -> None:
    """Each output's logprobs equal those of one full forward of `model` over prompt + output (temperature-scaled)."""
    for req in requests:
        o = outs[req.rid]
        seq = req.input_ids + o.output_ids
        logits = model.logits(model(torch.tensor([seq]), torch.arange(len(seq))[None], model.new_cache(1, len(seq)),
                                    torch.tensor([0])))[0]
        ref = torch.log_softmax(logits[len(req.input_ids) - 1: -1] / (req.params.temperature or 1.0), -1)
        ref = ref.gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.output_logprobs), ref, atol=1e-4 if device == "cpu" else 1e-3,
                                   rtol=0)


def assert_greedy_speculation_equals_plain(target, draft, make_requests) -> list:
    """NGRAM and a STANDALONE `draft` each decode greedily the tokens plain decoding of `target` does, verifying
    drafts on the way; the speculative engines, for further checks."""
    from slime_spec.engine.managers.engine_core import SpecConfig
    from slime_spec.speculative.settings import resolve_or_raise
    ngram = resolve_or_raise({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4})
    specs = (ngram, SpecConfig("STANDALONE", 3, 1, 4, str(draft)))
    return [engine for engine, _ in _greedy_runs_equal_plain(target, specs, make_requests)]


def assert_greedy_with_specs_equals_plain(target, specs, make_requests) -> list:
    """Engines of `target` with each of `specs` (e.g. a model's own MTP layer: NEXTN, an EAGLE tree) decode greedily
    the tokens plain decoding does, verifying drafts on the way; their outputs, for further checks."""
    return [outs for _, outs in _greedy_runs_equal_plain(target, specs, make_requests)]


def _greedy_runs_equal_plain(target, specs, make_requests) -> list:
    from slime_spec.engine.managers.engine_core import EngineCore
    plain = EngineCore(str(target), None, max_running_requests=4)
    base = run_to_completion(plain, make_requests(plain.tokenizer))
    runs = []
    for spec in specs:
        engine = EngineCore(str(target), spec, max_running_requests=4)
        outs = run_to_completion(engine, make_requests(engine.tokenizer))
        assert {r: o.output_ids for r, o in outs.items()} == {r: o.output_ids for r, o in base.items()}, spec
        assert sum(o.spec_verify_ct for o in outs.values()) > 0
        runs.append((engine, outs))
    return runs
