"""What the benchmark scripts share besides their models (engine_models.py)."""

from __future__ import annotations

from pathlib import Path


def publish(table: str, out: str | None) -> None:
    """Print the result table, and write it to `out` (a script's --out) when given."""
    print("\n" + table)
    if out:
        Path(out).write_text(table + "\n")
