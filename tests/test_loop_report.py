"""The run's summary and plot: smoothed series, honest axes, eval and canary series, a title that says
what ran."""

import math

import pytest

from slime_spec.driver.report import axis_limits, eval_names, plot, smooth, speedup_summary, summarize


def steps(n: int) -> list[dict]:
    out = []
    for i in range(n):
        s = {"rollout_id": i, "reward_mean": 0.4 + 0.05 * math.sin(i) + 0.003 * i,
             "spec_accept_length": 1.7 + 0.01 * i, "spec_canary_accept_length": 1.9 + 0.01 * i,
             "spec_accept_length_token_weighted": 1.8 + 0.01 * i + 0.1 * math.cos(i)}
        if i % 5 == 4:
            s.update({"eval/aime/reward_mean": 0.35 + 0.004 * i, "eval/aime/spec_accept_length": 1.75 + 0.01 * i,
                      "eval/aime/spec_accept_length_token_weighted": 1.85 + 0.01 * i})
        out.append(s)
    return out


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([2.0, 4.0], 1) == [2.0, 4.0]


def test_axes_start_at_their_baselines():
    assert axis_limits([0.41, 0.46], 0.0, 1.0) == (0.0, 1.0)  # a 0.05 change stays small
    lo, hi = axis_limits([1.5, 2.0, 3.0], 1.0)
    assert lo == 1.0 and hi == pytest.approx(3.2)
    assert axis_limits([], 1.0) == (1.0, 2.1)


def test_eval_names_in_order():
    assert eval_names(steps(10)) == ["aime"]
    assert eval_names([{"rollout_id": 0, "eval/a/reward_mean": 1, "eval/b/reward_mean": 0}]) == ["a", "b"]


def plotted(monkeypatch, *args, **kwargs) -> tuple[str, list[dict]]:
    """plot(*args, **kwargs), and what its figure held when saved: the title, and each panel's y label, y range and
    lines (label -> y values)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    seen = {}
    real_savefig = plt.Figure.savefig

    def capture(fig, path, **kw):
        seen["title"] = fig._suptitle.get_text()
        seen["panels"] = [{"ylabel": ax.get_ylabel(), "ylim": ax.get_ylim(),
                           "lines": {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}}
                          for ax in fig.axes]
        return real_savefig(fig, path, **kw)

    monkeypatch.setattr(plt.Figure, "savefig", capture)
    plot(*args, **kwargs)
    return seen["title"], seen["panels"]


def test_plot_writes_a_png_with_eval_and_canary(tmp_path, monkeypatch):
    title, panels = plotted(monkeypatch, steps(40), tmp_path / "plot.png", "MiMo-7B-RL on dapo-math-17k: GRPO",
                            extra={"draft frozen": steps(40)[:20]})
    assert (tmp_path / "plot.png").stat().st_size > 5000
    assert len(panels) == 2  # no speed-up panel without a measurement
    reward, accept = panels
    assert title == "MiMo-7B-RL on dapo-math-17k: GRPO"
    assert reward["ylim"] == (0.0, 1.0) and accept["ylim"][0] == 1.0
    assert "this run (rollouts, mean of 5)" in reward["lines"] and "this run: held-out eval 'aime'" in reward["lines"]
    assert "this run: canary after weight sync" in accept["lines"]
    assert "draft frozen: held-out eval 'aime'" in accept["lines"]


def test_the_accept_length_panel_draws_token_weighted_series_only(tmp_path, monkeypatch):
    """Rollouts, eval, canary and speed-up probe all in one meaning (tokens per verify pass over summed counters);
    slime's per-sample mean `spec_accept_length` is another quantity and is not drawn beside them."""
    run = steps(10)
    _, (_, accept) = plotted(monkeypatch, run, tmp_path / "plot.png")
    assert accept["ylabel"].startswith("accept length, token-weighted")
    assert accept["lines"]["this run: held-out eval 'aime'"] == pytest.approx(
        [s["eval/aime/spec_accept_length_token_weighted"] for s in run if "eval/aime/reward_mean" in s])
    drawn = {y for line in accept["lines"].values() for y in line}
    assert not drawn & {s["spec_accept_length"] for s in run}
    assert not drawn & {s["eval/aime/spec_accept_length"] for s in run if "eval/aime/spec_accept_length" in s}


def with_speedup(n: int, plain_s: float) -> list[dict]:
    out = steps(n)
    for s in out[3::4]:
        s.update(spec_speedup=plain_s / 2.0, spec_speedup_plain_s=plain_s, spec_speedup_spec_s=2.0)
    return out


def test_summary_states_the_whole_run_speedup():
    run = with_speedup(12, 3.0)
    run[-1].update(spec_speedup=2.0, spec_speedup_plain_s=4.0, spec_speedup_spec_s=2.0)
    s = summarize(run)
    assert s["spec_speedup"] == pytest.approx((3.0 + 3.0 + 4.0) / 6.0)  # summed times, not a mean of ratios
    assert (s["spec_speedup_first"], s["spec_speedup_last"], s["spec_speedup_measurements"]) == (1.5, 2.0, 3)
    assert speedup_summary(steps(4))["spec_speedup"] is None


def test_the_whole_step_speedup_puts_the_plain_rollout_time_in_the_step():
    """A step of 10 s whose 4 s rollout ran 1.5x faster than plain decoding would have taken 12 s with a plain
    rollout: 1.2x for the step. Over the run the steps' times are summed, as for spec_speedup."""
    from slime_spec.speculative.speedup import step_speedup, step_speedup_metrics
    assert step_speedup(10.0, 4.0, 1.5) == pytest.approx(1.2)
    assert step_speedup(10.0, 4.0, None) is None
    assert step_speedup_metrics({"step_time_s": 10.0, "rollout_time_s": 4.0, "spec_speedup": 1.5,
                                 "spec_speedup_frozen": 1.25}) == pytest.approx(
        {"spec_speedup_step": 1.2, "spec_speedup_step_frozen": 1.1})
    run = with_speedup(8, 3.0)  # spec_speedup 1.5 at steps 3 and 7
    for s, (step_s, rollout_s) in zip(run[3::4], ((10.0, 4.0), (20.0, 2.0))):
        s.update(step_time_s=step_s, rollout_time_s=rollout_s)
    summary = summarize(run)
    assert summary["spec_speedup_step"] == pytest.approx((12.0 + 21.0) / 30.0)
    assert "spec_speedup_step_frozen" not in summary


def test_plot_has_a_speedup_panel_from_zero_with_the_plain_line(tmp_path, monkeypatch):
    _, panels = plotted(monkeypatch, with_speedup(20, 3.0), tmp_path / "plot.png", "tiny MiMo on addition",
                        label="MTP trained online", extra={"draft frozen": with_speedup(20, 1.6)})
    assert (tmp_path / "plot.png").exists()
    assert len(panels) == 3
    ylim, lines = panels[2]["ylim"], panels[2]["lines"]
    assert ylim[0] == 0.0 and ylim[1] > 1.5
    assert lines["plain decoding (1.0x)"] == [1.0, 1.0]
    assert lines["MTP trained online (measured every few steps)"] == [1.5] * 5
    assert lines["draft frozen (measured every few steps)"] == [0.8] * 5


def test_the_accept_rate_gets_a_panel_and_quarter_means_when_measured(tmp_path, monkeypatch):
    """The accept rate is the draft's quality: under an adaptive k, accept length moves with the k chosen, so a
    frozen draft falling behind its policy shows in the rate; the plot and the summary carry it."""
    def run(first: float, last: float) -> list[dict]:
        return [{"rollout_id": i, "reward_mean": 0.5, "spec_accept_length": 3.5,
                 "spec_accept_rate": first + (last - first) * i / 19} for i in range(20)]

    s = summarize(run(0.88, 0.80))
    assert s["accept_rate_first_quarter_mean"] == pytest.approx(0.88 - 0.08 * 2 / 19)
    assert s["accept_rate_last_quarter_mean"] == pytest.approx(0.80 + 0.08 * 2 / 19)
    _, panels = plotted(monkeypatch, run(0.88, 0.91), tmp_path / "plot.png", label="MTP trained online",
                        extra={"draft frozen": run(0.88, 0.80)})
    assert len(panels) == 3 and panels[2]["ylabel"].startswith("accept rate")
    assert panels[2]["ylim"] == (0.0, 1.0)
    assert summarize([{"rollout_id": 0, "reward_mean": 0.5}])["accept_rate_first_quarter_mean"] is None


def with_frozen(n: int) -> list[dict]:
    """A run whose speed-up measurements also timed the draft frozen at its start (--spec-speedup-frozen-draft):
    plain 3.0 s, online 2.0 s, frozen 2.0 s then slower as the policy drifts from it."""
    out = with_speedup(n, 3.0)
    for j, s in enumerate(out[3::4]):
        s.update(spec_speedup_frozen=3.0 / (2.0 + 0.25 * j), spec_speedup_frozen_s=2.0 + 0.25 * j,
                 spec_speedup_accept_rate=0.9, spec_speedup_frozen_accept_rate=0.9 - 0.02 * j,
                 spec_speedup_frozen_accept_length=3.6 - 0.1 * j)
    return out


def test_summary_states_the_frozen_drafts_speedup_beside_the_online_one():
    s = summarize(with_frozen(12))  # measurements at steps 3, 7, 11
    assert s["spec_speedup"] == pytest.approx(1.5)
    assert s["spec_speedup_frozen"] == pytest.approx(9.0 / (2.0 + 2.25 + 2.5))  # summed times
    assert (s["spec_speedup_frozen_first"], s["spec_speedup_frozen_last"]) == (1.5, pytest.approx(3.0 / 2.5))
    assert (s["spec_speedup_frozen_accept_rate_first"], s["spec_speedup_frozen_accept_rate_last"]) == (
        0.9, pytest.approx(0.86))
    assert s["spec_speedup_accept_rate_last"] == 0.9
    assert "spec_speedup_frozen" not in summarize(with_speedup(12, 3.0))  # not measured: no frozen keys


def test_plot_draws_the_frozen_draft_in_the_speedup_and_accept_panels(tmp_path, monkeypatch):
    run = with_frozen(20)
    for s in run:
        s["spec_accept_rate"] = 0.9
    _, panels = plotted(monkeypatch, run, tmp_path / "plot.png", "tiny MiMo on addition", label="MTP trained online")
    frozen = "draft frozen at its start (same prompts and weights, measured)"  # one run: no run prefix
    by_label = {" ".join(p["ylabel"].split(" ")[:2]): p["lines"] for p in panels}
    assert by_label["spec_speedup (plain"][frozen] == pytest.approx([3.0 / (2.0 + 0.25 * j) for j in range(5)])
    assert by_label["spec_speedup (plain"]["MTP trained online (measured every few steps)"] == [1.5] * 5
    assert by_label["accept rate"][frozen] == pytest.approx([0.9 - 0.02 * j for j in range(5)])
    assert by_label["accept length,"][frozen] == pytest.approx([3.6 - 0.1 * j for j in range(5)])
    assert frozen not in by_label["reward (mean"]


def test_plot_and_axes_skip_nonfinite_values(tmp_path, monkeypatch):
    """A NaN or inf metric (a reward that was not finite) is no point on the plot; the plot is still written."""
    run = steps(8)
    run[2]["reward_mean"] = float("nan")
    run[3]["reward_mean"] = float("inf")
    run[4]["spec_accept_length_token_weighted"] = float("-inf")
    assert axis_limits([0.5, float("nan"), float("inf")], 0.0, 1.0) == (0.0, 1.0)
    _, (reward, accept) = plotted(monkeypatch, run, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").is_file()
    assert all(math.isfinite(y) for line in reward["lines"].values() for y in line)
    assert len(reward["lines"]["this run (rollouts)"]) == 6 and reward["ylim"] == (0.0, 1.0)
    assert all(math.isfinite(y) for y in accept["ylim"])


def test_step_line_reads_at_a_glance_with_slimes_eval_keys_and_the_drafts_loss():
    from slime_spec.driver.report import draft_loss_key, step_line
    step = {"rollout_id": 3, "num_samples": 64, "response_tokens": 9000, "rollout_time_s": 4.2,
            "tokens_per_s": 2142.9, "spec_accept_length": 2.5, "spec_verify_ct": 3600, "reward_mean": 0.4,
            "truncated_ratio": 0.0, "aborted": 0, "engine_restarts": 0, "engine_0/spec_accept_length": 2.5,
            "time_share_engine": 0.9, "loss": 0.0123, "mtp_loss": 0.0, "draft_loss": 1.25, "weight_sync_s": 0.31,
            "weight_sync_gbps": 2.0, "eval/eval/reward_mean": 0.5, "eval/eval/spec_accept_length": 2.0}
    line = step_line(step, draft_loss_key([step]))
    assert line == ("rollout 3 | reward 0.400 | accept_len 2.50 | 64 samples, 2143 tok/s, 4.2s | loss 0.0123 | "
                    "draft_loss 1.2500 | sync 0.31s | eval/eval 0.500")
    # a model whose MTP layers are trained shows mtp_loss; the trainer's 0.0 placeholder is not a loss
    assert draft_loss_key([{"mtp_loss": 0.0}]) is None and draft_loss_key([{"mtp_loss": 2.1}]) == "mtp_loss"
