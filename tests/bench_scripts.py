"""bench/ scripts as modules for their tests: bench/ is no package, so a script is loaded from its file, with bench/
on sys.path (scripts import their siblings as run from there) and in sys.modules (their dataclasses look it up)."""

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


@contextmanager
def bench_script(name: str):
    """bench/<name>.py, loaded as the module `bench_<name>` for the time of the block."""
    module_name = f"bench_{name}"
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(module_name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(module_name, None)
        sys.path.remove(str(BENCH))
