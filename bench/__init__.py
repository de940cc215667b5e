"""Benchmarks: each module is a script that measures compared paths side by side and prints a table of ratios.

Run one as `python bench/<name>.py`, `python -m bench.<name>` or `slime-spec bench <name>` (README.md lists them).
Shared pieces: `engine_models.py` (the tiny targets and drafts the engine benchmarks measure), `common.py`.
"""
