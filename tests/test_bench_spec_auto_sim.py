"""bench/spec_auto_sim.py: the scripted GPU case prints the right answer and the policy's shares per seed."""

import importlib.util
from pathlib import Path


def load_bench():
    path = Path(__file__).resolve().parents[1] / "bench" / "spec_auto_sim.py"
    spec = importlib.util.spec_from_file_location("spec_auto_sim", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sim_prints_the_best_k_and_a_row_per_seed(capsys):
    load_bench().main(["--seeds", "2", "--steps", "400"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("best k 3")
    rows = [line for line in out if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 2
    for row in rows:
        shares = [float(x) for x in row.split("|")[2].split("/")]
        assert abs(sum(shares) - 1.0) < 0.02 and shares[3] > 0.9  # settles on k = 3
