"""Adaptive speculation: our resolve and our runtime rule against SGLang 0.5.23's own functions."""

import json
import random
import types

import pytest

from slime_spec.engine.speculative.policy import AdaptiveSteps
from slime_spec.speculative.settings import resolve


def sglang_adaptive(initial_steps, config_path):
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    return AdaptiveSpeculativeParams(initial_steps=initial_steps, cfg_path=config_path)


CONFIGS = [
    None,
    {"1": {"candidate_steps": [1, 2, 4]}, "4": {"candidate_steps": [0, 2], "down_hysteresis": 0.3}},
    {"ema_alpha": 0.5, "warmup_batches": 2, "update_interval": 1,
     "2": {"candidate_steps": [0, 1, 2, 3], "ceiling_coeff": 1.5, "up_hysteresis": 0.2}},
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("initial", [1, 3])
def test_adaptive_steps_follow_sglang(tmp_path, config, initial):
    """Fed the same verify results, both pick the same steps at every batch size, step after step."""
    path = None
    if config is not None:
        path = tmp_path / "adaptive.json"
        path.write_text(json.dumps(config))
        path = str(path)
    theirs, ours = sglang_adaptive(initial, path), AdaptiveSteps(initial, path)
    rng = random.Random(7)
    for _ in range(600):
        bs = rng.choice([1, 2, 3, 5, 8, 16, 40, 70])
        k = ours.choose(bs)
        assert k == theirs.get_steps_for_batch(bs)
        quality = rng.random()
        accepted = [min(k, int(rng.random() * quality * (k + 2))) for _ in range(bs)]
        theirs.on_verify_complete(accepted, bs)
        ours.observe(bs, k, accepted, 0.0, 0.0)
    assert ours.max_num_steps == max(theirs.candidate_steps)


RESOLVE_CASES = [
    {"speculative_algorithm": "EAGLE", "speculative_adaptive": True},
    {"speculative_algorithm": "EAGLE", "speculative_adaptive": True, "speculative_num_steps": 1},
    {"speculative_algorithm": "EAGLE", "speculative_adaptive": True, "speculative_num_steps": 2},
    {"speculative_algorithm": "EAGLE", "speculative_adaptive": True, "attn_dp_size": 2, "tp_size": 2},
    {"speculative_algorithm": "EAGLE", "speculative_adaptive": True, "enable_two_batch_overlap": True},
    {"speculative_algorithm": "EAGLE", "speculative_adaptive": True, "enable_pdmux": True},
    {"speculative_algorithm": "EAGLE", "speculative_adaptive": True, "speculative_eagle_topk": 2},
    {"speculative_algorithm": "NGRAM", "speculative_adaptive": True},
]


@pytest.mark.parametrize("server_args", RESOLVE_CASES)
def test_adaptive_resolution_and_its_disabling_reason_follow_sglang(monkeypatch, server_args):
    """SGLang's handle_speculative_decoding on a ServerArgs (its model config replaced by a test double: loading
    it needs modules that cannot import here) against resolve: same shape, adaptive kept or turned off, and
    SGLang's reason in our finding when it turns it off."""
    import sglang.srt.arg_groups.speculative_hook as hook
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason

    arch = "MiMoForCausalLM"
    fake_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=[arch]))
    monkeypatch.setattr(hook, "model_config_of", lambda server_args: fake_config)
    monkeypatch.setattr(hook, "_handle_iquest_q1_mtp_draft", lambda server_args: False)
    args = ServerArgs(model_path="/nonexistent-target", device="cpu", page_size=1, **server_args)
    args._resolved_overrides = []
    reason = adaptive_unsupported_reason(args)
    try:
        hook.handle_speculative_decoding(args)
        view = resolved_view(args)
        theirs = (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens,
                  view.speculative_adaptive)
    except (AssertionError, TypeError, ValueError) as e:
        theirs = e
    config, findings = resolve(server_args, target_config={"architectures": [arch], "num_nextn_predict_layers": 1},
                               backend="sglang")
    if isinstance(theirs, Exception):
        assert any(f.level == "error" for f in findings), (theirs, findings)
        return
    assert (config.speculative_num_steps, config.speculative_eagle_topk, config.speculative_num_draft_tokens,
            config.speculative_adaptive) == theirs
    disabled = [f for f in findings if f.code == "SPEC_ADAPTIVE"]
    assert bool(disabled) == (reason is not None)
    if reason is not None:
        assert reason.split(" (")[0] in disabled[0].message
