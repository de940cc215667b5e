"""bench/spec_auto_sim.py: the scripted GPU case prints the right answer and the policy's shares per seed."""

from bench import spec_auto_sim


def test_the_sim_prints_the_best_k_and_a_row_per_seed(capsys):
    spec_auto_sim.main(["--seeds", "2", "--steps", "400"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("best k 3")
    rows = [line for line in out if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 2
    for row in rows:
        shares = [float(x) for x in row.split("|")[2].split("/")]
        assert abs(sum(shares) - 1.0) < 0.02 and shares[3] > 0.9  # settles on k = 3
