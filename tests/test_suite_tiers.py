"""The nightly tier (pytest.ini): each nightly test names the per-commit test of its capability, and that test
exists and runs per commit (tests/conftest.py checks it at every collection)."""

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
    ([item("tests/a.py::fast"), item("tests/a.py::slow", covered_by="tests/a.py::fats")], "names no test"),
    ([item("tests/a.py::fast", covered_by="tests/b.py::other"),
      item("tests/a.py::slow", covered_by="tests/a.py::fast")], "is itself nightly"),
])
def test_a_nightly_test_without_a_per_commit_cover_stops_the_collection(items, says):
    with pytest.raises(pytest.UsageError, match=says):
        check_tiers(None, items)


def test_a_cover_in_a_file_not_collected_is_not_judged():
    check_tiers(None, [item("tests/a.py::slow", covered_by="tests/b.py::fast")])
