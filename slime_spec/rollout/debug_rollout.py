"""`--debug-rollout-only`: run `num_rollout` rollouts with no trainer and no weight sync.

This is how a speculative-decoding problem is isolated from training: the same engines, flags,
data and metrics as a training run, and nothing else.
"""

from __future__ import annotations

import ray

from slime_spec.config.run_config import Config
from slime_spec.rollout.manager import start_rollout_manager
from slime_spec.speculative.stats import accept_length


def summarize(per_rollout: list[dict]) -> dict:
    """Totals over the rollouts; accept length token-weighted over all of them."""
    tokens = sum(m["response_tokens"] for m in per_rollout)
    time_s = sum(m["rollout_time_s"] for m in per_rollout)
    completion = sum(m["spec_completion_tokens"] for m in per_rollout)
    verify = sum(m["spec_verify_ct"] for m in per_rollout)
    rewards = [m["reward_mean"] for m in per_rollout if m["reward_mean"] is not None]
    return {
        "num_rollouts": len(per_rollout),
        "num_samples": sum(m["num_samples"] for m in per_rollout),
        "response_tokens": tokens,
        "rollout_time_s": time_s,
        "tokens_per_s": tokens / time_s if time_s > 0 else 0.0,
        "spec_accept_length_token_weighted": accept_length(completion, verify),
        "spec_verify_ct": verify,
        "aborted": sum(m["aborted"] for m in per_rollout),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "engine_restarts": sum(m["engine_restarts"] for m in per_rollout),
        "rollouts": per_rollout,
    }


def format_summary(s: dict) -> str:
    reward = "n/a" if s["reward_mean"] is None else f"{s['reward_mean']:.3f}"
    return (f"debug-rollout-only: {s['num_rollouts']} rollouts, {s['num_samples']} samples, "
            f"{s['response_tokens']} tokens in {s['rollout_time_s']:.2f}s ({s['tokens_per_s']:.1f} tok/s), "
            f"accept length (token-weighted) {s['spec_accept_length_token_weighted']:.3f} over "
            f"{s['spec_verify_ct']} verify passes, "
            f"reward {reward}, aborted {s['aborted']}, engine restarts {s['engine_restarts']}")


def run_debug_rollout_only(config: Config, **manager_kwargs) -> dict:
    """Start the engines, run the rollouts, print and return the summary; engines always stop."""
    if not ray.is_initialized():
        ray.init()
    manager = start_rollout_manager(config, **manager_kwargs)
    try:
        per_rollout = []
        for rollout_id in range(config.rollout.num_rollout):
            ray.get(manager.generate.remote(rollout_id))
            per_rollout.append(ray.get(manager.get_last_metrics.remote()))
        summary = summarize(per_rollout)
        print(format_summary(summary), flush=True)
        return summary
    finally:  # Ctrl-C and failures included: no engine outlives the driver
        try:
            ray.get(manager.shutdown.remote())
        except ray.exceptions.RayActorError as e:  # its constructor failed and already stopped the engines
            print(f"[rollout] the rollout manager is already gone: {type(e).__name__}", flush=True)
        ray.kill(manager)
