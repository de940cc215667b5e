"""Per-rollout metrics: speculative acceptance, throughput, truncation, reward.

`rollout_metrics` is pure (samples in, flat dict out). The same dict goes to the console
(`format_metrics_line`), to wandb (`WandbLogger`) and to `--metrics-jsonl` (`write_metrics_line`,
which other parts call with their own keys for the same rollout line).

Accept length is reported two ways because they disagree on skewed batches (definitions: speculative/stats.py):
- `spec_accept_length`: the mean of per-sample ratios, slime's meaning under slime's name (short
  samples weigh as much as long ones);
- `spec_accept_length_token_weighted`: sum(completion_tokens) / sum(verify passes), what the engines
  saw per verify pass, the meaning of every other accept length (canary, speed-up probe).
A sample that made several requests contributes its summed raw counters (`SpecStats`).
"""

from __future__ import annotations

import json
import netrc
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from slime_spec.config.run_config import WandbConfig
from slime_spec.rollout.sample import Sample, Status
from slime_spec.speculative.stats import SpecStats, mean_accept_length

REQUIRED_KEYS = ("rollout_id", "num_samples", "response_tokens", "rollout_time_s", "tokens_per_s",
                 "spec_accept_length", "spec_verify_ct", "reward_mean", "engine_restarts")


def spec_summary(samples: list[Sample]) -> dict:
    """Speculative counters and ratios over a set of samples (no key prefix; definitions: speculative/stats.py)."""
    total = SpecStats.total(s.spec for s in samples)
    return {
        "spec_completion_tokens": total.completion_tokens,
        "spec_verify_ct": total.verify_ct,
        "spec_accept_length": mean_accept_length(s.spec for s in samples),
        "spec_accept_length_token_weighted": total.accept_length,
        "spec_accept_rate": total.accept_rate,
        "spec_draft_tokens": total.draft_token_num,
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
        for key in ("spec_accept_length", "spec_accept_length_token_weighted", "spec_verify_ct", "spec_accept_rate"):
            m[f"engine_{e}/{key}"] = spec[key]
    return m


SPEC_PHASES = ("draft", "verify", "sampling", "plain")  # the embedded engine's StepTimes, in seconds as `{phase}_s`


def time_shares(before: Mapping[int, dict], after: Mapping[int, dict], rollout_time_s: float) -> dict:
    """Where a rollout's wall time went, from the engines' cumulative counters (GET /server_info internal state,
    embedded engine) read before and after it. `time_share_engine`: seconds inside engine steps over engines x
    rollout seconds; the rest, `time_share_outside_engine`, is HTTP, JSON, tokenization, queues and engines idle
    at the tail. `time_share_{draft,verify,sampling,plain}`: each speculative phase's share of the engine-step
    seconds (speculative.StepTimes). Engines without the counters (real SGLang) or whose counters went back
    (restarted) are left out; no engine left, no keys."""
    pairs = [(before[i], after[i]) for i in after if i in before and "engine_step_s" in after[i]
             and after[i]["engine_step_s"] >= before[i].get("engine_step_s", float("inf"))]
    if not pairs or rollout_time_s <= 0:
        return {}
    engine_s = sum(a["engine_step_s"] - b["engine_step_s"] for b, a in pairs)
    out = {"time_share_engine": engine_s / (len(pairs) * rollout_time_s)}
    out["time_share_outside_engine"] = 1.0 - out["time_share_engine"]
    timed = [(b["spec_step_times"], a["spec_step_times"]) for b, a in pairs
             if "spec_step_times" in a and "spec_step_times" in b]
    if timed and engine_s > 0:
        for phase in SPEC_PHASES:
            out[f"time_share_{phase}"] = sum(a[f"{phase}_s"] - b[f"{phase}_s"] for b, a in timed) / engine_s
    return out


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def format_metrics_line(m: dict) -> str:
    """One console line per rollout that reads at a glance; every other key (per-engine accept lengths, time
    shares, token-weighted accept length, verify counts, ...) is in the metrics JSONL."""
    parts = [f"rollout {m['rollout_id']}", f"reward {_fmt(m['reward_mean'])}"]
    if m.get("truncated_ratio"):
        parts.append(f"truncated {m['truncated_ratio']:.0%}")
    if m.get("spec_verify_ct"):  # speculative decoding ran
        parts.append(f"accept_len {m['spec_accept_length']:.2f}")
    parts.append(f"{m['num_samples']} samples, {m['tokens_per_s']:.0f} tok/s, {m['rollout_time_s']:.1f}s")
    if m.get("aborted"):
        parts.append(f"ABORTED {m['aborted']}")
    if m.get("engine_restarts"):
        parts.append(f"engine restarts {m['engine_restarts']}")
    return " | ".join(parts)


def format_speedup(m: dict) -> str | None:
    """The `--spec-speedup-interval` measurement of a step in a few words, or None when the step has none (its
    accept lengths and rates, passes and token counts are in the metrics JSONL)."""
    if m.get("spec_speedup") is None:
        return None
    passes = m.get("spec_speedup_passes") or 1
    median = f", median of {passes} passes" if passes > 1 else ""
    line = f"spec_speedup {m['spec_speedup']:.2f}x ({m['spec_speedup_plain_s']:.2f}s plain / " \
           f"{m['spec_speedup_spec_s']:.2f}s speculative{median})"
    if m.get("spec_speedup_frozen") is not None:
        line += f", draft frozen {m['spec_speedup_frozen']:.2f}x"
    if m.get("spec_speedup_step") is not None:
        line += f"; whole step {m['spec_speedup_step']:.2f}x"
    return line


def write_metrics_line(path: str | os.PathLike, metrics: dict) -> None:
    """Append one JSON object (one rollout, or any other part's keys for it) to a JSONL file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(metrics, default=float) + "\n")


# Our flat step keys -> slime's wandb names (slime/observability: rollout_metrics.py, train_metric_utils.py).
SLIME_KEY_NAMES = {
    "reward_mean": "rollout/raw_reward",
    "response_len_mean": "rollout/response_len/mean",
    "rollout_time_s": "perf/rollout_time",
    "tokens_per_s": "perf/rollout_tokens_per_sec",
    "samples_per_s": "perf/rollout_samples_per_sec",
    "train_time_s": "perf/train_time",
    "step_time_s": "perf/step_time",
    "weight_sync_s": "perf/update_weights_time",
    "weight_sync_gbps": "perf/update_weights_gbps",
    "weight_sync_params": "perf/update_weights_target_tensors",
    "weight_sync_mtp_params": "perf/update_weights_mtp_tensors",
}
TRAIN_KEYS = {"loss", "pg_loss", "kl", "clip_fraction", "entropy", "mtp_loss", "grad_norm", "lr",
              "tis", "tis_clipfrac", "tis_abs",
              "draft_loss", "draft_acc_step0", "draft_acc_last",
              "train_rollout_logprob_abs_diff", "replayed_samples"}
# slime's step keys: each namespace is plotted against its own step (wandb.define_metric).
STEP_METRICS = (("rollout/step", ("rollout/*", "perf/*")), ("train/step", ("train/*",)), ("eval/step", ("eval/*",)))


def eval_key(key: str) -> str:
    """`eval/<name>/reward_mean` -> `eval/<name>` (slime's eval reward), `.../truncated_ratio` ->
    `eval/<name>-truncated_ratio`; other eval keys keep their name."""
    head, _, metric = key.rpartition("/")
    if metric == "reward_mean":
        return head
    if metric == "truncated_ratio":
        return f"{head}-truncated_ratio"
    return key


def slime_log_keys(step: dict, train_steps_per_rollout: int = 1) -> dict:
    """One merged step dict (rollout + train + weight sync + eval) under slime's names and step keys.

    Rollout statistics go to `rollout/`, timings and throughput to `perf/`, trainer output to `train/`,
    held-out evaluation to `eval/<name>`; None values are left out. `train/step` counts optimizer steps
    as slime does (`train_steps_per_rollout` per rollout).
    """
    rollout_id = step["rollout_id"]
    out: dict = {"rollout/step": rollout_id}
    for key, value in step.items():
        if value is None or key == "rollout_id":
            continue
        if key in SLIME_KEY_NAMES:
            out[SLIME_KEY_NAMES[key]] = value
        elif key in TRAIN_KEYS:
            out[f"train/{key}"] = value
        elif key.startswith("eval/"):
            out[eval_key(key)] = value
        elif key.startswith("spec_speedup"):  # a timing, as slime's perf/ keys
            out[f"perf/{key}"] = value
        else:
            out[f"rollout/{key}"] = value
    if any(k.startswith("train/") for k in out):
        out["train/step"] = (rollout_id + 1) * train_steps_per_rollout - 1
    if any(k.startswith("eval/") for k in out):
        out["eval/step"] = rollout_id
    return out


def wandb_logged_in(environ: Mapping[str, str], host: str | None) -> bool:
    """Whether `wandb login` stored a key for the host (in ~/.netrc, or the file NETRC names)."""
    hostname = urlparse(host or environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = environ.get("NETRC") or os.path.join(environ.get("HOME", os.path.expanduser("~")), ".netrc")
    try:
        auth = netrc.netrc(path).authenticators(hostname)
    except (FileNotFoundError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def wandb_mode(flag_mode: str | None, environ: Mapping[str, str], has_key: bool, logged_in: bool) -> tuple[str, str]:
    """(mode, why): --wandb-mode, else WANDB_MODE, else online with any credentials, else offline."""
    if flag_mode:
        return flag_mode, "--wandb-mode"
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"], "WANDB_MODE"
    if has_key:
        return "online", "an API key (--wandb-key or WANDB_API_KEY)"
    if logged_in:
        return "online", "the key stored by `wandb login`"
    return "offline", ("no API key and no `wandb login`: the run is written locally only "
                       "(run `wandb login`, or pass --wandb-key or --wandb-mode online)")


class WandbLogger:
    """One wandb run under slime's metric names (`slime_log_keys`); the mode is chosen by `wandb_mode` and
    printed with its reason, so an offline run is never a surprise."""

    def __init__(self, cfg: WandbConfig, run_config: dict | None = None, train_steps_per_rollout: int = 1,
                 environ: Mapping[str, str] = os.environ):
        import wandb

        key = cfg.wandb_key or environ.get("WANDB_API_KEY")
        mode, why = wandb_mode(cfg.wandb_mode, environ, bool(key), wandb_logged_in(environ, cfg.wandb_host))
        print(f"[wandb] mode {mode}: {why}", flush=True)
        if cfg.wandb_key and mode == "online":
            wandb.login(key=cfg.wandb_key, host=cfg.wandb_host, relogin=True)
        self.train_steps_per_rollout = train_steps_per_rollout
        if cfg.wandb_dir:  # wandb writes its files (offline runs too) under <dir>/wandb
            os.makedirs(cfg.wandb_dir, exist_ok=True)
        self.run = wandb.init(entity=cfg.wandb_team, project=cfg.wandb_project or "slime-spec", group=cfg.wandb_group,
                              dir=cfg.wandb_dir, mode=mode, id=cfg.wandb_run_id,
                              resume="allow" if cfg.wandb_run_id else None, config=run_config or {},
                              reinit="create_new")
        for step_key, patterns in STEP_METRICS:
            self.run.define_metric(step_key)
            for pattern in patterns:
                self.run.define_metric(pattern, step_metric=step_key)

    def log(self, metrics: dict, step: int | None = None) -> None:
        """`step` is the rollout id when `metrics` has none."""
        keyed = slime_log_keys({"rollout_id": step, **metrics}, self.train_steps_per_rollout)
        self.run.log(keyed)

    def finish(self) -> None:
        self.run.finish()


def server_spec_info(states: dict[int, dict]) -> dict:
    """The engines' own running average accept length, for cross-checking."""
    return {f"engine_{i}/server_avg_spec_accept_length": float(state["avg_spec_accept_length"])
            for i, state in states.items() if state.get("avg_spec_accept_length") is not None}
