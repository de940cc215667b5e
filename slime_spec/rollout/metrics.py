"""Per-rollout metrics: speculative acceptance, throughput, truncation, reward.

`rollout_metrics` is pure (samples in, flat dict out). The same dict goes to the console
(`format_metrics_line`), to wandb (`WandbLogger`) and to `--metrics-jsonl` (`write_metrics_line`,
which other parts call with their own keys for the same rollout line).

Accept length is reported two ways because they disagree on skewed batches:
- `spec_accept_length`: token-weighted, sum(completion_tokens) / sum(verify passes);
- `spec_accept_length_sample_mean`: the mean of per-sample ratios (what slime logs), which lets
  short samples weigh as much as long ones.
A sample that made several requests contributes its summed raw counters (see `SpecStats`).
Without any verify pass (no speculation) the accept length is 1.0, as in SGLang's tests.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

from slime_spec.config import WandbConfig
from slime_spec.rollout.sample import Sample, Status

REQUIRED_KEYS = ("rollout_id", "num_samples", "response_tokens", "rollout_time_s", "tokens_per_s",
                 "spec_accept_length", "spec_verify_ct", "reward_mean", "engine_restarts")


def spec_summary(samples: list[Sample]) -> dict:
    """Speculative counters and ratios over a set of samples (no key prefix)."""
    completion = sum(s.spec.completion_tokens for s in samples)
    verify = sum(s.spec.verify_ct for s in samples)
    ratios = [s.spec.accept_length for s in samples if s.spec.verify_ct > 0]
    reporting = [s for s in samples if s.spec.accept_token_num is not None and s.spec.draft_token_num is not None]
    drafted = sum(s.spec.draft_token_num for s in reporting)
    return {
        "spec_completion_tokens": completion,
        "spec_verify_ct": verify,
        "spec_accept_length": completion / verify if verify else 1.0,
        "spec_accept_length_sample_mean": sum(ratios) / len(ratios) if ratios else 1.0,
        "spec_accept_rate": (sum(s.spec.accept_token_num for s in reporting) / drafted) if drafted else None,
        "spec_draft_tokens": drafted if reporting else None,
    }


def rollout_metrics(rollout_id: int, samples: list[Sample], rollout_time_s: float, engine_restarts: int = 0) -> dict:
    n = len(samples)
    response_tokens = sum(s.response_length for s in samples)
    rewards = [s.reward for s in samples if s.reward is not None]
    status_count = {st: sum(s.status == st for s in samples) for st in Status}
    m = {
        "rollout_id": rollout_id,
        "num_samples": n,
        "response_tokens": response_tokens,
        "prompt_tokens": sum(s.prompt_length for s in samples),
        "rollout_time_s": rollout_time_s,
        "tokens_per_s": response_tokens / rollout_time_s if rollout_time_s > 0 else 0.0,
        "samples_per_s": n / rollout_time_s if rollout_time_s > 0 else 0.0,
        "response_len_mean": response_tokens / n if n else 0.0,
        "truncated_ratio": status_count[Status.TRUNCATED] / n if n else 0.0,
        "aborted": status_count[Status.ABORTED],
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "engine_restarts": engine_restarts,
        **spec_summary(samples),
    }
    by_engine: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        if s.engine_index is not None:
            by_engine[s.engine_index].append(s)
    for e in sorted(by_engine):
        spec = spec_summary(by_engine[e])
        m[f"engine_{e}/num_samples"] = len(by_engine[e])
        for key in ("spec_accept_length", "spec_accept_length_sample_mean", "spec_verify_ct", "spec_accept_rate"):
            m[f"engine_{e}/{key}"] = spec[key]
    return m


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def format_metrics_line(m: dict) -> str:
    """One readable console line per rollout, with a per-engine accept-length tail."""
    parts = [f"rollout {m['rollout_id']}: {m['num_samples']} samples", f"{m['response_tokens']} tokens",
             f"{m['rollout_time_s']:.2f}s", f"{m['tokens_per_s']:.1f} tok/s",
             f"accept_len {_fmt(m['spec_accept_length'])} (sample mean {_fmt(m['spec_accept_length_sample_mean'])})",
             f"accept_rate {_fmt(m['spec_accept_rate'])}", f"verify {m['spec_verify_ct']}",
             f"truncated {m['truncated_ratio']:.0%}", f"reward {_fmt(m['reward_mean'])}",
             f"restarts {m['engine_restarts']}"]
    if m["aborted"]:
        parts.append(f"ABORTED {m['aborted']}")
    engines = sorted({k.split("/")[0] for k in m if k.startswith("engine_") and "/" in k})
    if engines:
        parts.append("per engine accept_len " + " ".join(
            f"{e[len('engine_'):]}:{_fmt(m[f'{e}/spec_accept_length'])}" for e in engines))
    return " | ".join(parts)


def write_metrics_line(path: str | os.PathLike, metrics: dict) -> None:
    """Append one JSON object (one rollout, or any other part's keys for it) to a JSONL file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(metrics, default=float) + "\n")


class WandbLogger:
    """wandb run for rollout metrics; offline unless a key is given (`--wandb-key` or WANDB_API_KEY)."""

    def __init__(self, cfg: WandbConfig, run_config: dict | None = None):
        import wandb

        self._wandb = wandb
        key = cfg.wandb_key or os.environ.get("WANDB_API_KEY")
        if cfg.wandb_key:
            wandb.login(key=cfg.wandb_key, relogin=True)
        self.run = wandb.init(project=cfg.wandb_project or "slime-spec", group=cfg.wandb_group,
                              dir=cfg.wandb_dir, mode="online" if key else "offline",
                              config=run_config or {}, reinit="create_new")

    def log(self, metrics: dict, step: int) -> None:
        self.run.log({f"rollout/{k}": v for k, v in metrics.items() if v is not None}, step=step)

    def finish(self) -> None:
        self.run.finish()
