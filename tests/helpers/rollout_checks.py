"""What a `--debug-rollout-only` run on two engines must report, per rollout: its metrics line against the samples
it saved (`--save-debug-rollout-data`)."""

from __future__ import annotations

import json
from pathlib import Path

from slime_spec.rollout.debug_data import load_rollout
from slime_spec.rollout.metrics import REQUIRED_KEYS


def check_rollouts_on_two_engines(metrics_jsonl: Path, saved: str, num_rollout: int, samples: int) -> list[dict]:
    """Every rollout's `samples` served by the two engines (a GRPO group by one of them; both engines serve over the
    run), none aborted, speculation drafting and verifying, and the per-engine and token counts adding up to what
    the saved samples hold; the metrics lines, for further checks."""
    lines = [json.loads(x) for x in metrics_jsonl.read_text().splitlines()]
    assert [m["rollout_id"] for m in lines] == list(range(num_rollout))
    for i in (0, 1):
        assert sum(m.get(f"engine_{i}/num_samples", 0) for m in lines) > 0, f"engine {i} served no sample"
    for m in lines:
        assert set(REQUIRED_KEYS) <= set(m)
        assert m["num_samples"] == samples and m["aborted"] == 0 and m["engine_restarts"] == 0
        assert m["spec_accept_length"] >= 1.0 and m["spec_verify_ct"] > 0
        assert m["spec_draft_tokens"] > 0 and 0.0 <= m["spec_accept_rate"] <= 1.0
        assert m["spec_completion_tokens"] == m["response_tokens"]
        assert m.get("engine_0/num_samples", 0) + m.get("engine_1/num_samples", 0) == m["num_samples"]
        # each engine's verify passes add up to the rollout's
        assert m.get("engine_0/spec_verify_ct", 0) + m.get("engine_1/spec_verify_ct", 0) == m["spec_verify_ct"]
        saved_samples = load_rollout(saved, m["rollout_id"])
        assert sum(s.response_length for s in saved_samples) == m["response_tokens"]
        assert sum(s.spec.verify_ct for s in saved_samples) == m["spec_verify_ct"]
    return lines


def keep_even_prompts(args, samples, **kwargs):
    """A dynamic-sampling filter for tests (`--dynamic-sampling-filter-path`): keeps the groups of even prompt
    indices of --prompt-data, drops the others with reason `odd_prompt`."""
    from slime_spec.rollout.dynamic_sampling import DynamicFilterOutput

    keep = samples[0].metadata["prompt_index"] % 2 == 0
    return DynamicFilterOutput(keep=keep, reason=None if keep else "odd_prompt")
