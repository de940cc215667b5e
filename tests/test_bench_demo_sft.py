"""bench/demo_sft.py: both precisions train the same batches and the table reports both, float32 first."""

from bench import demo_sft


def test_table_reports_speed_against_float32_and_the_tail_loss():
    out = demo_sft.table([("float32", [2.0, 2.0, 2.0], [3.0, 1.0, 0.5], [4.0, 2.0, 1.0]),
                          ("bfloat16", [1.0, 1.0, 1.0], [3.0, 1.0, 0.7], [4.0, 2.0, 1.2])], tail=2)
    lines = out.splitlines()
    assert lines[2] == "| float32 | 2.000 | 1.00x | 0.7500 | 1.5000 |"
    assert lines[3] == "| bfloat16 | 1.000 | 2.00x | 0.8500 | 1.6000 |"


def test_quick_run_trains_both_precisions(capsys):
    demo_sft.main(["--quick", "--steps", "4", "--block", "2", "--tail", "2"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| float32") or line.startswith("| bfloat16")]
    assert len(rows) == 2
    for row in rows:
        loss = float(row.split("|")[4])
        assert 0.0 < loss < 10.0
    assert "step 4/4: float32 loss" in out
