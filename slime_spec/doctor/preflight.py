"""What a run's files can be checked for before any work: the prompt data line by line, the prompts
--rollout-max-prompt-len leaves out, the output directories (writable, room for one checkpoint), and a
--load / --save pair that would overwrite saved iterations. Doctor (and so training's preflight) reports these.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from slime_spec.config.run_config import Config
from slime_spec.doctor.codes import Finding, Rule

# Bytes per parameter of one checkpoint: the weights (bf16 or fp32), AdamW's two fp32 moments and, with --bf16,
# the fp32 master copy (trainer/checkpoint.py, precision.py).
ADAM_STATE_BYTES = 8
MASTER_BYTES = 4
SAFETENSORS_ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def prompt_token_counts(config: Config, tokenizer, path: str) -> tuple[list[int] | None, list[Finding]]:
    """Each prompt's token count (None without a tokenizer), every line of `path` checked first."""
    from slime_spec.rollout.data import PromptDataError, read_prompt_rows, render_prompt
    r = config.rollout
    try:
        rows = read_prompt_rows(path, r.input_key, r.label_key, text_labels=not r.custom_rm_path)
    except PromptDataError as e:
        return None, [Rule.PROMPT_DATA_INVALID.finding(error=e)]
    if tokenizer is None:
        return None, []
    counts, problems = [], []
    for row in rows:
        try:
            text = render_prompt(row.raw, tokenizer, r.apply_chat_template)
        except ValueError as e:
            problems.append(f"line {row.line}: field {r.input_key!r}: {e}")
            continue
        counts.append(len(tokenizer.encode(text, add_special_tokens=False)))
    if problems:
        return None, [Rule.PROMPT_DATA_INVALID.finding(error=f"--prompt-data {path}: " + "; ".join(problems[:5]))]
    return counts, []


def dropped_prompt_findings(config: Config, counts: list[int]) -> list[Finding]:
    limit = config.rollout.rollout_max_prompt_len
    if not limit:
        return []
    dropped = sum(n > limit for n in counts)
    if not dropped:
        return []
    rule = Rule.PROMPTS_ALL_DROPPED if dropped == len(counts) else Rule.PROMPTS_DROPPED
    return [rule.finding(limit=limit, dropped=dropped, total=len(counts), longest=max(counts))]


def _existing_ancestor(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path("/")


def _writable_finding(flag: str, directory: str) -> Finding | None:
    path = Path(directory).absolute()
    if path.exists() and not path.is_dir():
        return Rule.OUTPUT_NOT_WRITABLE.finding(flag=flag, path=path, why="it is a file, not a directory")
    base = _existing_ancestor(path)
    if not os.access(base, os.W_OK | os.X_OK):
        what = "it is not writable" if base == path else f"it does not exist and {base} is not writable"
        return Rule.OUTPUT_NOT_WRITABLE.finding(flag=flag, path=path, why=f"{what} by this user")
    return None


def model_parameter_count(hf_checkpoint: str) -> int | None:
    """Elements of every tensor in the checkpoint's *.safetensors files (their headers only); None without any."""
    files = sorted(Path(hf_checkpoint).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= d
                total += n
    return total


def checkpoint_bytes(config: Config) -> int | None:
    """An estimate of one --save checkpoint of this model (weights + AdamW state [+ fp32 masters])."""
    n = model_parameter_count(config.train.hf_checkpoint)
    if n is None:
        return None
    bf16 = config.train.bf16
    return n * ((2 if bf16 else 4) + ADAM_STATE_BYTES + (MASTER_BYTES if bf16 else 0))


def output_findings(config: Config) -> list[Finding]:
    """--output-dir and --save writable; --save with room for one checkpoint."""
    out = []
    dirs = [("--output-dir", config.output_dir)] + ([("--save", config.train.save)] if config.train.save else [])
    for flag, directory in dirs:
        finding = _writable_finding(flag, directory)
        if finding is not None:
            out.append(finding)
    if config.train.save and not config.debug_rollout_only and not out:
        need = checkpoint_bytes(config)
        base = _existing_ancestor(Path(config.train.save).absolute())
        free = shutil.disk_usage(base).free
        if need is not None and free < need:
            out.append(Rule.OUTPUT_NO_ROOM.finding(path=config.train.save, free=_gib(free), need=_gib(need),
                                                   base=base))
    return out


def resume_findings(config: Config) -> list[Finding]:
    """--load / --save that would overwrite saved iterations (trainer/checkpoint.py plan_resume)."""
    from slime_spec.trainer.checkpoint import CheckpointError, plan_resume
    if config.debug_rollout_only:
        return []
    try:
        plan_resume(config.train.load, config.train.save)
    except CheckpointError as e:
        return [Rule.CHECKPOINT_WOULD_OVERWRITE.finding(error=e)]
    return []


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
