"""bench/speedup_noise.py: the ratios it groups into medians and the table it prints (pure parts)."""

import pytest

from bench import speedup_noise


def test_ratios_take_the_median_of_each_group_of_rounds():
    num, den = [2.0, 9.0, 2.2, 3.0, 3.1, 2.9, 5.0], [1.0, 1.1, 1.2, 1.0, 1.5, 1.0, 1.0]
    assert speedup_noise.ratios(num, den) == pytest.approx([2.0, 9.0 / 1.1, 2.2 / 1.2, 3.0, 3.1 / 1.5, 2.9, 5.0])
    assert speedup_noise.ratios(num, den, 3) == pytest.approx([2.2 / 1.1, 3.0 / 1.0])  # the 7th round: no full group


def test_table_rows_per_pass_and_per_median():
    seconds = {"spec_a": [1.0, 1.0, 1.0], "spec_b": [1.1, 0.9, 1.0], "plain": [2.0, 2.0, 2.0]}
    out = speedup_noise.table(seconds, {"spec_a": [0.03, 0.04, 0.3]}, repeats=3).splitlines()
    assert out[2] == ("| spec_b time / spec_a time (identical engines) | one pass | 3 | 0.900 / 1.000 / 1.100 "
                      "| +-10% |")
    assert out[3] == ("| spec_b time / spec_a time (identical engines) | median of 3 | 1 | 1.000 / 1.000 / 1.000 "
                      "| +-0% |")
    assert out[5] == "| spec_speedup (plain time / spec_a time) | median of 3 | 1 | 2.000 / 2.000 / 2.000 | +-0% |"
    assert out[6].startswith("| stall of spec_a (wall - engine steps, s) | one pass | 3 | 0.030 / 0.040 / 0.300 |")


def test_refuses_a_missing_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="run `make demo` first"):
        speedup_noise.main(["--model", str(tmp_path)])


@pytest.mark.nightly(covered_by="tests/test_bench_speedup_noise.py::test_table_rows_per_pass_and_per_median")
def test_a_short_run_times_identical_engines_and_prints_the_table(tmp_path, capsys):
    from slime_spec.tools.tiny_model import make_tiny_model
    model = make_tiny_model(tmp_path / "mimo", arch="mimo", hidden_size=32, num_layers=1, mtp_layers=1)
    assert speedup_noise.main(["--model", str(model), "--rounds", "2", "--repeats", "2", "--prompts", "1",
                               "--samples", "2", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "| spec_b time / spec_a time (identical engines) | median of 2 | 1 |" in out
    assert "| stall of plain (wall - engine steps, s) | one pass | 2 |" in out
