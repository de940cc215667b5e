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


def _bench(rest: list[str]) -> int:
    bench_dir = Path(__file__).resolve().parent.parent / "bench"
    if not rest or not (bench_dir / f"{rest[0]}.py").exists():
        found = sorted(p.stem for p in bench_dir.glob("*.py"))
        print(f"slime-spec bench: choose one of {found}", file=sys.stderr)
        return 2
    sys.argv = [str(bench_dir / f"{rest[0]}.py"), *rest[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
