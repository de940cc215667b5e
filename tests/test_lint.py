"""ruff (lint and import order, configured in ruff.toml) passes over the package, the tests and the benchmarks."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PATHS = ("slime_spec", "tests", "bench")


def ruff_command() -> list[str]:
    """ruff from the same environment as the tests (requirements.txt pins it), else from PATH."""
    beside = Path(sys.executable).with_name("ruff")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: `pip install -r requirements.txt` (it pins ruff)")
    return [found]


def test_ruff_check_passes():
    result = subprocess.run([*ruff_command(), "check", "--no-cache", "--output-format", "concise", *PATHS],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (f"`ruff check {' '.join(PATHS)}` found problems (most fix with "
                                    f"`ruff check --fix {' '.join(PATHS)}`):\n{result.stdout}{result.stderr}")
