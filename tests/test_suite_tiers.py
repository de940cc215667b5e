"""The nightly tier (pytest.ini): each nightly test names the per-commit test of its capability, and that test
exists and runs per commit (over the whole suite here; tests/conftest.py checks the tier at every collection)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import pytest_collection_modifyitems as check_tiers


def item(nodeid, covered_by=None, nightly=False):
    marks = {"nightly": SimpleNamespace(kwargs={} if covered_by is None else {"covered_by": covered_by})} \
        if nightly or covered_by else {}
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=marks.get)


def test_a_nightly_test_covered_by_a_per_commit_one_passes():
    check_tiers(None, [item("tests/a.py::fast"), item("tests/a.py::slow", covered_by="tests/a.py::fast")])


@pytest.mark.parametrize("items, says", [
    ([item("tests/a.py::slow", nightly=True)], "needs covered_by"),
    ([item("tests/a.py::fast", covered_by="tests/b.py::other"),
      item("tests/a.py::slow", covered_by="tests/a.py::fast")], "is itself nightly"),
])
def test_a_nightly_test_without_a_per_commit_cover_stops_the_collection(items, says):
    with pytest.raises(pytest.UsageError, match=says):
        check_tiers(None, items)


def test_a_cover_not_collected_is_not_judged_in_a_partial_run():
    check_tiers(None, [item("tests/a.py::slow", covered_by="tests/b.py::fast")])


def test_every_nightly_test_of_the_suite_names_a_per_commit_test_that_exists(tmp_path):
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "tiers.json"
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "tests.helpers.suite_tiers", "tests"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "SUITE_TIERS_OUT": str(out)}, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tiers = json.loads(out.read_text())
    nightly = {test: cover for test, cover in tiers.items() if cover is not None}
    assert nightly, "no nightly test: `make test-nightly` would run nothing"
    missing = {test: cover for test, cover in nightly.items() if cover not in tiers or tiers[cover] is not None}
    assert not missing, f"nightly tests whose cover is not a per-commit test of the suite: {missing}"
