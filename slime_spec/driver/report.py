"""What a training run shows a person: a line per step, metrics JSONL, wandb, a summary table and a plot.

One merged dict per step (rollout + train + weight-sync + canary keys) goes to the console,
to `--metrics-jsonl` (default `<output-dir>/metrics.jsonl`), and to wandb when `--use-wandb`.
At the end: a summary table on the console, `summary.json` and `plot.png` in the output dir.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from slime_spec.config.run_config import Config
from slime_spec.rollout.metrics import WandbLogger, eval_key, format_metrics_line, format_speedup, write_metrics_line
from slime_spec.speculative.speedup import step_speedup

TABLE_COLUMNS = [  # (key, header, format)
    ("rollout_id", "step", "{}"),
    ("reward_mean", "reward", "{:.3f}"),
    ("spec_accept_length", "accept_len", "{:.2f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("loss", "loss", "{:.4f}"),
    ("mtp_loss", "mtp_loss", "{:.4f}"),
    ("draft_loss", "draft_loss", "{:.4f}"),  # an external (EAGLE3) draft trained online
    ("weight_sync_s", "sync_s", "{:.2f}"),
    ("spec_canary_accept_length", "canary", "{:.2f}"),
    ("spec_speedup", "speedup", "{:.2f}x"),
    ("spec_speedup_frozen", "frozen", "{:.2f}x"),  # --spec-speedup-frozen-draft
]


def format_cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (TypeError, ValueError):
        return str(value)


def draft_loss_key(steps: list[dict]) -> str | None:
    """The loss of the run's draft: `draft_loss` for an external draft; `mtp_loss` only where MTP layers were
    trained (an exact 0.0 is the trainer's placeholder for a model without them)."""
    if any("draft_loss" in s for s in steps):
        return "draft_loss"
    return "mtp_loss" if any(s.get("mtp_loss") for s in steps) else None


def summary_table(steps: list[dict]) -> str:
    draft = draft_loss_key(steps)
    cols = [c for c in TABLE_COLUMNS if any(c[0] in s for s in steps)
            and (c[0] not in ("mtp_loss", "draft_loss") or c[0] == draft)]
    rows = [[h for _, h, _ in cols]] + [[format_cell(s.get(k), f) for k, _, f in cols] for s in steps]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summarize(steps: list[dict]) -> dict:
    def series(key):
        return [s.get(key) for s in steps]

    def first_last(key):
        vals = [v for v in series(key) if v is not None]
        return (vals[0], vals[-1]) if vals else (None, None)

    r0, r1 = first_last("reward_mean")
    a0, a1 = first_last("spec_accept_length")
    return {"num_steps": len(steps), "reward_first": r0, "reward_last": r1,
            "reward_first_quarter_mean": quarter_mean(series("reward_mean"), first=True),
            "reward_last_quarter_mean": quarter_mean(series("reward_mean"), first=False),
            "accept_length_first": a0, "accept_length_last": a1,
            "accept_length_first_quarter_mean": quarter_mean(series("spec_accept_length"), first=True),
            "accept_length_last_quarter_mean": quarter_mean(series("spec_accept_length"), first=False),
            "accept_rate_first_quarter_mean": quarter_mean(series("spec_accept_rate"), first=True),
            "accept_rate_last_quarter_mean": quarter_mean(series("spec_accept_rate"), first=False),
            "weight_sync_s_mean": _mean(series("weight_sync_s")), "tokens_per_s_mean": _mean(series("tokens_per_s")),
            **speedup_summary(steps), "rollouts": steps}


def speedup_summary(steps: list[dict]) -> dict:
    """`--spec-speedup-interval`'s measurements over the run: plain seconds / speculative seconds, summed over
    every measurement (the run's whole-run ratio), and the first and last measurement; the same for the
    frozen-draft engine (`--spec-speedup-frozen-draft`), with each draft's accept rate at the first and last."""
    measured = [s for s in steps if s.get("spec_speedup") is not None]
    out = {"spec_speedup": None, "spec_speedup_first": None, "spec_speedup_last": None,
           "spec_speedup_measurements": len(measured)}
    if not measured:
        return out
    plain = sum(s["spec_speedup_plain_s"] for s in measured)
    out.update(spec_speedup=plain / sum(s["spec_speedup_spec_s"] for s in measured),
               spec_speedup_first=measured[0]["spec_speedup"], spec_speedup_last=measured[-1]["spec_speedup"],
               spec_speedup_accept_rate_first=measured[0].get("spec_speedup_accept_rate"),
               spec_speedup_accept_rate_last=measured[-1].get("spec_speedup_accept_rate"))
    if all("step_time_s" in s and "rollout_time_s" in s for s in measured):
        step_s = sum(s["step_time_s"] for s in measured)
        for key in ("spec_speedup", "spec_speedup_frozen"):  # the steps' times with every rollout decoded plainly
            if all(s.get(key) is not None for s in measured):
                plain_step_s = sum(s["step_time_s"] * step_speedup(s["step_time_s"], s["rollout_time_s"], s[key])
                                   for s in measured)
                out[key.replace("spec_speedup", "spec_speedup_step")] = plain_step_s / step_s
    if all(s.get("spec_speedup_frozen") is not None for s in measured):
        out.update(spec_speedup_frozen=plain / sum(s["spec_speedup_frozen_s"] for s in measured),
                   spec_speedup_frozen_first=measured[0]["spec_speedup_frozen"],
                   spec_speedup_frozen_last=measured[-1]["spec_speedup_frozen"],
                   spec_speedup_frozen_accept_rate_first=measured[0].get("spec_speedup_frozen_accept_rate"),
                   spec_speedup_frozen_accept_rate_last=measured[-1].get("spec_speedup_frozen_accept_rate"))
    return out


def quarter_mean(values, first: bool):
    """Mean over the first (or last) quarter of the steps: a trend that one noisy step cannot fake."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    k = max(1, len(vals) // 4)
    part = vals[:k] if first else vals[-k:]
    return sum(part) / len(part)


def _mean(values):
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is so far)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _series(steps: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(step, value) of the steps that measured `key`; a non-finite value is no point (the summary table and
    metrics.jsonl still show it)."""
    pairs = [(s["rollout_id"], s[key]) for s in steps if _plottable(s.get(key))]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _plottable(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def eval_names(steps: list[dict]) -> list[str]:
    """Held-out sets in the steps (`eval/<name>/reward_mean`), in order of appearance."""
    names: list[str] = []
    for s in steps:
        for k in s:
            if k.startswith("eval/") and k.endswith("/reward_mean") and k.count("/") == 2 and k[5:-12] not in names:
                names.append(k[5:-12])
    return names


def axis_limits(values: list[float], floor: float, ceiling: float | None = None) -> tuple[float, float]:
    """An honest y range: from a meaningful baseline (`floor`, or below it when the data goes there: a reward with
    a penalty can be negative), never a zoom onto the noise."""
    values = [v for v in values if _plottable(v)]
    floor = min([floor, *values])
    top = max(values, default=floor + 1.0)
    if ceiling is not None and top <= ceiling:
        return floor, ceiling
    return floor, top + 0.1 * max(top - floor, 1e-9)


# The accept-length panel is token-weighted throughout (rollouts, eval, canary, speed-up probe: speculative/stats.py);
# slime's per-sample `spec_accept_length` is a different mean and stays in the table and metrics.jsonl.
ACCEPT_LENGTH = "spec_accept_length_token_weighted"
PANELS = (  # (key, title: what the panel shows, y label: the quantity, short enough for the panel's height,
    #         baseline, range kept when the data fits in it)
    ("reward_mean", "Reward", "reward (mean per rollout)", 0.0, 1.0),
    (ACCEPT_LENGTH, "Accept length: tokens per verify pass (1 = no draft token accepted)",
     "accept length, token-weighted", 1.0, None),
)
ACCEPT_RATE_PANEL = ("spec_accept_rate", "Accept rate: the draft's quality", "accept rate (accepted / drafted)",
                     0.0, 1.0)
SPEEDUP_PANEL = ("spec_speedup", "Speed-up of speculative rollout over plain decoding",
                 "spec_speedup (plain / spec. time)", 0.0, None)
FROZEN_SERIES = {"spec_speedup": "spec_speedup_frozen", "spec_accept_rate": "spec_speedup_frozen_accept_rate",
                 ACCEPT_LENGTH: "spec_speedup_frozen_accept_length"}
FROZEN_COLOR = "tab:red"


def plot(steps: list[dict], path: Path, title: str = "slime-spec", extra: dict[str, list[dict]] | None = None,
         label: str = "this run") -> None:
    """Reward and token-weighted accept length over steps, each raw (faint) and smoothed; held-out eval and canary
    series when present; the accept rate per drafted token (the draft's quality, which accept length mixes with the
    k an adaptive policy chose) and the measured speed-up (`--spec-speedup-interval`) in further panels when any
    run has them; `extra` overlays other runs (e.g. a frozen draft).

    Axes start at their baselines (reward 0, accept length 1.0 = no token accepted, speed-up 0 with a line at
    1.0 = as fast as plain decoding) so a small change looks small; a reward within [0, 1] keeps the [0, 1] range,
    a negative one (a penalty) extends it below 0.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {label: steps, **(extra or {})}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    window = max(1, len(steps) // 8)
    def measured(key: str) -> bool:
        return any(_series(r, key)[1] for r in runs.values())

    panels = (PANELS + ((ACCEPT_RATE_PANEL,) if measured("spec_accept_rate") else ())
              + ((SPEEDUP_PANEL,) if measured("spec_speedup") else ()))
    cols = min(2, len(panels))  # at most two panels a row: each wide enough for its legend and labels
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        fig.delaxes(ax)
    for ax, (key, panel_title, ylabel, floor, ceiling) in zip(axes.flat, panels):
        if key == "spec_speedup":
            ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="plain decoding (1.0x)")
        shown: list[float] = []
        for i, (name, run_steps) in enumerate(runs.items()):
            xs, ys = _series(run_steps, key)
            if not ys:
                continue
            color = colors[i % len(colors)]
            if key == "spec_speedup":  # one point per measurement: no smoothing over so few
                ax.plot(xs, ys, color=color, marker="o", linewidth=2, label=f"{name} (measured every few steps)")
                shown += ys
            fxs, fys = _series(run_steps, FROZEN_SERIES.get(key, ""))
            if fys:  # --spec-speedup-frozen-draft: the same prompts and policy, the draft as launched
                frozen = "draft frozen at its start (same prompts and weights, measured)"
                ax.plot(fxs, fys, color=FROZEN_COLOR, marker="v", linewidth=2, linestyle="-.",
                        label=frozen if len(runs) == 1 else f"{name}: {frozen}")
                shown += fys
            if key == "spec_speedup":
                continue
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1, marker="o" if len(xs) < 30 else None,
                    markersize=3)
            ax.plot(xs, smooth(ys, window), color=color, linewidth=2,
                    label=f"{name} (rollouts{f', mean of {window}' if window > 1 else ''})")
            shown += ys
            for j, ev in enumerate(eval_names(run_steps)):
                exs, eys = _series(run_steps, f"eval/{ev}/{key}")
                if eys:
                    ax.plot(exs, eys, color=color, linestyle="--", marker="s", markersize=4,
                            label=f"{name}: held-out eval '{ev}'")
                    shown += eys
            if key == ACCEPT_LENGTH:
                cxs, cys = _series(run_steps, "spec_canary_accept_length")
                if cys:
                    ax.plot(cxs, cys, color=color, linestyle=":", marker="^", markersize=4,
                            label=f"{name}: canary after weight sync")
                    shown += cys
        ax.set_ylim(*axis_limits(shown + ([1.0] if key == "spec_speedup" else []), floor, ceiling))
        ax.set_title(panel_title, fontsize=11)
        ax.set_xlabel("rollout step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if shown:
            ax.legend(fontsize=8, loc="best")
    fig.suptitle(textwrap.fill(title, width=40 * cols))
    fig.tight_layout(rect=(0, 0, 1, 0.95 if rows > 1 else 0.92))  # room for the title
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_title(config: Config) -> str:
    """'<model> on <task>': the checkpoint's and the prompt file's names."""
    model = Path(config.rollout.hf_checkpoint).name or "model"
    task = Path(config.rollout.prompt_data).stem if config.rollout.prompt_data else "replayed rollouts"
    spec = config.engine.server_args.get("speculative_algorithm")
    return f"{model} on {task}: GRPO" + (f", {spec} speculative rollout" if spec else "")


def step_line(step: dict, draft_loss: str | None) -> str:
    """The console line of a step: the rollout's glance line, the update's loss, the draft's loss (`draft_loss`),
    the sync's time, eval rewards under slime's keys, the canary and the speed-up when measured."""
    if "num_samples" in step:
        line = format_metrics_line(step)
    else:
        line = f"rollout {step['rollout_id']}: replayed {step.get('replayed_samples', 0)} samples"
    extras = [f"{k} {format_cell(step.get(k), '{:.4f}')}" for k in ("loss", draft_loss) if k and k in step]
    extras += [f"{label} {step[k]}" for k, label in (("reward_left_out", "samples left out for their reward"),
                                                     ("skipped_steps", "SKIPPED optimizer steps")) if step.get(k)]
    if "weight_sync_s" in step:
        extras.append(f"sync {step['weight_sync_s']:.2f}s")
    extras += [f"{eval_key(k)} {format_cell(v, '{:.3f}')}" for k, v in step.items()
               if k.startswith("eval/") and k.endswith("/reward_mean")]
    if step.get("spec_canary_accept_length") is not None:
        extras.append(f"canary accept_len {step['spec_canary_accept_length']:.2f}")
    if format_speedup(step):
        extras.append(format_speedup(step))
    return line + ("" if not extras else " | " + " | ".join(extras))


class LoopReport:
    def __init__(self, config: Config):
        self.out_dir = Path(config.output_dir)
        self.metrics_path = Path(config.rollout.metrics_jsonl or self.out_dir / "metrics.jsonl")
        self.steps: list[dict] = []
        self.initial_eval: dict | None = None
        self.title = run_title(config)
        steps_per_rollout = max(1, config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
                                // (config.train.global_batch_size or 1))
        self.wandb = WandbLogger(config.wandb, {"train": vars(config.train), "rollout": vars(config.rollout)},
                                 steps_per_rollout) if config.wandb.use_wandb else None

    def set_initial_eval(self, metrics: dict) -> None:
        self.initial_eval = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        rewards = {eval_key(k): v for k, v in self.initial_eval.items() if k.endswith("/reward_mean")}
        print("initial eval (before training): " + ", ".join(f"{k} {format_cell(v, '{:.3f}')}"
                                                            for k, v in rewards.items()), flush=True)

    def add(self, step: dict) -> None:
        if not self.steps:
            print(f"[report] one line per step below; every metric of each step goes to {self.metrics_path}",
                  flush=True)
        self.steps.append(step)
        print(step_line(step, draft_loss_key(self.steps)), flush=True)
        write_metrics_line(self.metrics_path, step)
        if self.wandb:
            self.wandb.log(step, step=step["rollout_id"])

    def finish(self, title: str | None = None) -> dict:
        summary = summarize(self.steps)
        summary["eval_initial"] = self.initial_eval
        summary["eval_final"] = next(({k: v for k, v in s.items() if k.startswith("eval/")}
                                      for s in reversed(self.steps) if any(k.startswith("eval/") for k in s)), None)
        print("\n" + summary_table(self.steps), flush=True)
        if summary["spec_speedup"] is not None:
            print(f"spec_speedup over the run: {summary['spec_speedup']:.2f}x (plain / speculative time, "
                  f"{summary['spec_speedup_measurements']} measurements; first {summary['spec_speedup_first']:.2f}x, "
                  f"last {summary['spec_speedup_last']:.2f}x)", flush=True)
        if summary.get("spec_speedup_step") is not None:
            frozen = summary.get("spec_speedup_step_frozen")
            print(f"whole-step speed-up over those steps: {summary['spec_speedup_step']:.2f}x (each step's time with "
                  "its rollout decoded plainly / its time" + (f"; draft frozen {frozen:.2f}x" if frozen else "")
                  + ")", flush=True)
        if summary.get("spec_speedup_frozen") is not None:
            print(f"spec_speedup with the draft frozen at its start: {summary['spec_speedup_frozen']:.2f}x (same "
                  f"prompts and weights; first {summary['spec_speedup_frozen_first']:.2f}x, last "
                  f"{summary['spec_speedup_frozen_last']:.2f}x)", flush=True)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        if self.steps:
            plot(self.steps, self.out_dir / "plot.png", title or self.title)
        if self.wandb:
            self.wandb.finish()
        return summary

