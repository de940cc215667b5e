"""A pytest plugin for tests/test_suite_tiers.py: after collection, every test's node id and, for a nightly test,
the cover it names, written as JSON to the path in SUITE_TIERS_OUT."""

import json
import os


def pytest_collection_finish(session):
    tiers = {}
    for item in session.items:
        mark = item.get_closest_marker("nightly")
        tiers[item.nodeid] = None if mark is None else mark.kwargs.get("covered_by")
    with open(os.environ["SUITE_TIERS_OUT"], "w") as f:
        json.dump(tiers, f)
