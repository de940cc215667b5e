"""`slime-spec <subcommand>`: a thin dispatcher; each subcommand lives in its own module."""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path

SUBCOMMANDS = {
    "doctor": ("slime_spec.doctor.diagnose", "check a configuration (the same flags as training) before launch"),
    "train": ("slime_spec.driver.loop", "run the RL loop (same as python -m slime_spec.train)"),
    "push-weights": ("slime_spec.driver.push_weights", "push a checkpoint into running engines through the trainer's "
                                                 "weight sync, --check reads values back"),
    "make-tiny-model": ("slime_spec.tools.tiny_model", "write a small random HF checkpoint"),
    "bench": (None, "run a benchmark under bench/: slime-spec bench engine|rollout|weight_sync [flags]"),
}


def _usage() -> str:
    lines = ["usage: slime-spec <subcommand> [flags]", "", "subcommands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"slime-spec: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name == "bench":
        return _bench(rest)
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


BENCH_LIBRARIES = ("__init__", "common", "engine_models")  # modules of the bench package that are not scripts


def _bench(rest: list[str]) -> int:
    """Run bench/<name>.py as the module bench.<name> (the bench package, from the repository root)."""
    root = Path(__file__).resolve().parent.parent
    scripts = sorted(p.stem for p in (root / "bench").glob("*.py") if p.stem not in BENCH_LIBRARIES)
    if not rest or rest[0] not in scripts:
        print(f"slime-spec bench: choose one of {scripts}", file=sys.stderr)
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    sys.argv = [str(root / "bench" / f"{rest[0]}.py"), *rest[1:]]
    runpy.run_module(f"bench.{rest[0]}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
