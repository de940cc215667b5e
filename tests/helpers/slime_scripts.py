"""The argument arrays of upstream slime's run scripts (tests/data/slime_scripts/*.args, paths changed only).

Each line of a file is one of the script's arrays (MODEL_ARGS, CKPT_ARGS, ...) in shell quoting; `{data}` is
tests/data (stand-in checkpoints whose config.json has the real model's shape, a few prompts) and `{out}` a
directory the test owns (the script's --load / --save / --ref-load).
"""

from __future__ import annotations

import shlex
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
SCRIPTS = ("run-qwen3-4B", "run-mimo-7B-rl-eagle", "run-qwen3-30B-A3B", "run-glm4.7-30B-A3B")
DENSE = ("run-qwen3-4B", "run-mimo-7B-rl-eagle")


def script_argv(name: str, out: Path) -> list[str]:
    text = (DATA / "slime_scripts" / f"{name}.args").read_text()
    return [tok.replace("{data}", str(DATA)).replace("{out}", str(out)) for tok in shlex.split(text)]


MODEL_ARGS_LINE = 1  # the second line of each file: the script's MODEL_ARGS (scripts/models/*.sh)
KEPT_MODEL_ARGS = ("--mtp-num-layers",)  # not a shape: how many MTP layers to train


def without_model_args(name: str, out: Path) -> list[str]:
    """The script's flags less its MODEL_ARGS (the shape of the real model), as on a tiny stand-in: the trainer and
    the doctor read the shape from the stand-in's config.json. `--mtp-num-layers` stays."""
    lines = [line for line in (DATA / "slime_scripts" / f"{name}.args").read_text().splitlines() if line.strip()]
    model = shlex.split(lines[MODEL_ARGS_LINE])
    kept = [t for i, t in enumerate(model) if t in KEPT_MODEL_ARGS or (i and model[i - 1] in KEPT_MODEL_ARGS)]
    text = "\n".join(lines[:MODEL_ARGS_LINE] + [shlex.join(kept)] + lines[MODEL_ARGS_LINE + 1:])
    return [tok.replace("{data}", str(DATA)).replace("{out}", str(out)) for tok in shlex.split(text)]


def small_machine_argv(argv: list[str], env: dict, root: Path) -> list[str]:
    """`argv` with scripts/common.sh's environment overrides applied (SMALL_MACHINE=1, HF_CHECKPOINT, ...), as the
    cluster scripts apply them before the doctor and the job."""
    import subprocess

    apply = f'source "{root}/scripts/common.sh"; args=(); while IFS= read -r -d "" a; do args+=("$a"); done; ' \
            'slime_spec_apply_env "${args[@]}"; printf "%s\\0" "${SLIME_SPEC_ARGS[@]}"'
    done = subprocess.run(["bash", "-c", apply], input="".join(t + "\0" for t in argv), env=env,
                          capture_output=True, text=True, check=True)
    return [t for t in done.stdout.split("\0") if t]
