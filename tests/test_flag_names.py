"""Every `--flag` that slime_spec's messages, docstrings and argv lists name is a flag that exists.

Exists means: in the flag table (`slime_spec/config/flags.py`), in the installed SGLang's own server parser
(as `--x` for the engine command line and as `--sglang-x` on ours), an older SGLang spelling the CLI
translates (`args.SGLANG_RENAMED`), `slime-spec push-weights`' own flags, `slime-spec make-tiny-model`'s own
options (the `add_argument` calls of tiny_model.main), or one of the few flags of the other tools listed below.
"""

import ast
import re
from pathlib import Path

import pytest

from slime_spec.config.args import SGLANG_PREFIX, SGLANG_RENAMED, build_parser, sglang_parser
from slime_spec.driver import push_weights

PACKAGE = Path(__file__).resolve().parents[1] / "slime_spec"
FLAG_TOKEN = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")

# Flags of the other command lines slime-spec has or starts -> the module that defines or passes them.
OTHER_TOOL_FLAGS = {
    "--runtime-env-json": "cluster/ray_env.py",  # ray job submit (the job's runtime env)
    "--json": "doctor/diagnose.py",  # slime-spec doctor
    "--smoke": "demo/run.py",  # python -m slime_spec.demo
    "--out": "demo/run.py",
    "--layout": "demo/run.py",
    "--worker-urls": "rollout/router.py",  # sglang_router.launch_router, started for --use-sglang-router
    "--health-check-endpoint": "rollout/router.py",
    "--health-check-interval-secs": "rollout/router.py",
    "--health-check-timeout-secs": "rollout/router.py",
    "--health-failure-threshold": "rollout/router.py",
    "--health-success-threshold": "rollout/router.py",
}


def tiny_model_flags() -> set[str]:
    """`slime-spec make-tiny-model`'s options: the `--` names its `main` passes to `add_argument` (the parser is
    built inside `main`, so it is read from the source rather than called)."""
    tree = ast.parse((PACKAGE / "tools/tiny_model.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return {arg.value for node in ast.walk(main)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


def known_flags() -> set[str]:
    ours = {opt for parser in (build_parser(), push_weights.build_parser())
            for a in parser._actions for opt in a.option_strings if opt.startswith("--")}
    sglang = {opt for a in sglang_parser()._actions for opt in a.option_strings if opt.startswith("--")}
    return (ours | sglang | {SGLANG_PREFIX + o[2:] for o in sglang} | set(SGLANG_RENAMED) | tiny_model_flags()
            | set(OTHER_TOOL_FLAGS))


def flag_tokens(path: Path):
    """(line, token) for every `--flag` token in the string literals of one module (f-string parts included)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for token in FLAG_TOKEN.findall(node.value):
                yield node.lineno, token


def exists(token: str, known: set[str]) -> bool:
    if token.endswith("-"):  # a family such as `--sglang-<flag>` or `--eval-*`
        return any(k.startswith(token) for k in known)
    return token in known


def test_every_named_flag_exists():
    known = known_flags()
    missing = [f"slime_spec/{path.relative_to(PACKAGE)}:{line}: {token}"
               for path in sorted(PACKAGE.rglob("*.py")) for line, token in flag_tokens(path)
               if not exists(token, known)]
    assert not missing, "flags named in slime_spec that no parser defines:\n" + "\n".join(missing)


def test_other_tool_flags_are_still_used_where_listed():
    for flag, module in OTHER_TOOL_FLAGS.items():
        assert any(token == flag for _, token in flag_tokens(PACKAGE / module)), f"{flag} no longer in {module}"


def test_tiny_model_flags_are_its_parsers(capsys):
    """The options read from tiny_model's source are the ones its parser accepts (its --help lists each)."""
    from slime_spec.tools import tiny_model
    flags = tiny_model_flags()
    assert {"--arch", "--head-dim", "--num-experts-per-tok", "--out"} <= flags
    with pytest.raises(SystemExit) as exited:
        tiny_model.main(["--help"])
    assert exited.value.code == 0
    listed = set(FLAG_TOKEN.findall(capsys.readouterr().out))
    assert flags <= listed


def test_scanner_catches_a_flag_that_does_not_exist(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('raise ValueError(f"--max-concurrency {x!r}: use --sglang-server-concurrency")\n')
    known = known_flags()
    assert [t for _, t in flag_tokens(bad) if not exists(t, known)] == ["--max-concurrency"]
