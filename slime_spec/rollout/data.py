"""Prompt data: a JSONL file -> rollout batches of `Sample` groups.

The prompts form a stream: position p is prompt `order(epoch)[p % N]` of epoch p // N (each epoch shuffled
with `rollout_seed + epoch` when `rollout_shuffle`). A batch is a pure function of its start position, so a
rollout can be regenerated or replayed; `position(p)` is what a checkpoint saves (epoch, index, shuffle seed)
and `resume_at` continues from it whatever the batch size.

Every line is checked when the file is read, and a bad one is named by its line number and field: not UTF-8,
not JSON, not an object, no input field or an empty one, a missing or null label, a label that cannot match.
Labels are converted as slime reads them (`pd.read_json(..., dtype={"label": str})`): a number or a boolean
becomes its text; a list or an object is refused when the reward compares text (`text_labels`), else kept.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from slime_spec.rollout.sample import Sample

MAX_PROBLEMS_SHOWN = 5


class PromptDataError(ValueError):
    """--prompt-data holds lines that cannot be used; the message names each (line number and field)."""


@dataclass(frozen=True)
class Prompt:
    text: str  # what the engine sees (chat template applied when asked)
    raw: str | list[dict]  # the input field as written in the file
    label: object  # text, or (--custom-rm-path) the JSON value as written; None without --label-key
    token_ids: tuple[int, ...]


def _raise_problems(path: Path, problems: list[tuple[int, str]]) -> None:
    """PromptDataError listing (line number, problem) pairs in file order, the first MAX_PROBLEMS_SHOWN of them."""
    if problems:
        shown = "\n  ".join(f"line {line}: {p}" for line, p in sorted(problems)[:MAX_PROBLEMS_SHOWN])
        more = f"\n  ... and {len(problems) - MAX_PROBLEMS_SHOWN} more" if len(problems) > MAX_PROBLEMS_SHOWN else ""
        raise PromptDataError(f"--prompt-data {path}: {len(problems)} line(s) cannot be used:\n  {shown}{more}")


def _parse_lines(path: Path) -> tuple[list[tuple[int, dict]], list[tuple[int, str]]]:
    """(line number, object) of every non-blank line, and (line number, problem) of those that are not a UTF-8
    JSON object."""
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-data {path}: no such file")
    rows, problems = [], []
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append((lineno, f"not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})"))
            continue
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append((lineno, f"not valid JSON ({e})"))
            continue
        if not isinstance(row, dict):
            problems.append((lineno, f"a JSON {type(row).__name__}, not an object {{\"input\": ...}}"))
            continue
        rows.append((lineno, row))
    return rows, problems


def read_jsonl_lines(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, object) of every non-blank line; PromptDataError names every line that is not a UTF-8
    JSON object."""
    path = Path(path)
    rows, problems = _parse_lines(path)
    _raise_problems(path, problems)
    if not rows:
        raise PromptDataError(f"--prompt-data {path}: the file holds no prompts")
    return rows


def read_jsonl(path: str | Path) -> list[dict]:
    return [row for _, row in read_jsonl_lines(path)]


def convert_label(value, text_labels: bool) -> tuple[object, str | None]:
    """(label as the reward sees it, or the problem). Numbers and booleans become text as slime reads them."""
    if value is None:
        return None, "the label is null"
    if isinstance(value, str):
        return value, None
    if isinstance(value, (bool, int, float)):
        return str(value), None
    if text_labels:
        return None, (f"the label is a JSON {type(value).__name__} ({json.dumps(value)[:40]}), and the reward "
                      "compares text, so it could never match: write it as a string")
    return value, None  # a --custom-rm-path function gets it as written


@dataclass(frozen=True)
class PromptRow:
    line: int
    raw: str | list[dict]  # the input field as written in the file
    label: object


def read_prompt_rows(path: str | Path, input_key: str = "input", label_key: str | None = None,
                     text_labels: bool = True) -> list[PromptRow]:
    """The prompts of a JSONL file, every line checked (see the module docstring); no tokenizer needed."""
    path = Path(path)
    parsed, problems = _parse_lines(path)
    rows = []
    for lineno, row in parsed:
        if input_key not in row:
            problems.append((lineno, f"no field {input_key!r} (fields: {sorted(row)}); set --input-key"))
            continue
        raw = row[input_key]
        if not isinstance(raw, (str, list)):
            problems.append((lineno, f"field {input_key!r} is a JSON {type(raw).__name__}, not a string or a list "
                                     "of messages"))
            continue
        if not raw or (isinstance(raw, str) and not raw.strip()):
            problems.append((lineno, f"field {input_key!r} is empty: an empty prompt cannot be generated from"))
            continue
        label = None
        if label_key is not None:
            if label_key not in row:
                problems.append((lineno, f"no field {label_key!r} (fields: {sorted(row)}); set --label-key"))
                continue
            label, problem = convert_label(row[label_key], text_labels)
            if problem:
                problems.append((lineno, f"field {label_key!r}: {problem}"))
                continue
        rows.append(PromptRow(lineno, raw, label))
    _raise_problems(path, problems)
    if not rows and not problems:
        raise PromptDataError(f"--prompt-data {path}: the file holds no prompts")
    return rows


def render_prompt(raw, tokenizer, apply_chat_template: bool) -> str:
    """The prompt text: raw string, or the tokenizer's chat template over a string or a message list."""
    if apply_chat_template:
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
        if not (isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages)):
            raise ValueError("--apply-chat-template: the input must be a string or a list of "
                             f"{{'role': ..., 'content': ...}} messages, got {raw!r:.80}")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(raw, str):
        raise ValueError(f"prompt input is a {type(raw).__name__}, not a string: pass --apply-chat-template "
                         "to render message lists with the tokenizer's chat template")
    return raw


class PromptDataset:
    def __init__(self, path: str, tokenizer, *, input_key: str = "input", label_key: str | None = None,
                 apply_chat_template: bool = False, max_prompt_len: int | None = None,
                 shuffle: bool = False, seed: int = 42, text_labels: bool = True):
        """`text_labels`: the reward compares text (every --rm-type), so labels that cannot be text are refused."""
        self.path, self.shuffle, self.seed, self.max_prompt_len = path, shuffle, seed, max_prompt_len
        self.prompts: list[Prompt] = []
        self.num_filtered = 0
        problems = []
        for row in read_prompt_rows(path, input_key, label_key, text_labels):
            try:
                text = render_prompt(row.raw, tokenizer, apply_chat_template)
            except ValueError as e:
                problems.append((row.line, f"field {input_key!r}: {e}"))
                continue
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if not ids:
                problems.append((row.line, f"field {input_key!r} renders to no token"))
                continue
            if max_prompt_len is not None and len(ids) > max_prompt_len:
                self.num_filtered += 1
                continue
            self.prompts.append(Prompt(text, row.raw, row.label, ids))
        _raise_problems(Path(path), problems)
        if not self.prompts:
            raise PromptDataError(f"--prompt-data {path}: every prompt is longer than "
                                  f"--rollout-max-prompt-len={max_prompt_len}")

    def filtered_report(self) -> str | None:
        """The console line saying how many prompts --rollout-max-prompt-len left out, if any."""
        if not self.num_filtered:
            return None
        total = self.num_filtered + len(self.prompts)
        return (f"--rollout-max-prompt-len {self.max_prompt_len} leaves out {self.num_filtered} of {total} prompts "
                f"of {self.path} (longer than that); {len(self.prompts)} remain")

    def __len__(self) -> int:
        return len(self.prompts)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def stream_positions(self, start: int, count: int) -> list[tuple[int, int]]:
        """(epoch, dataset index) of stream positions start .. start + count - 1; position p is epoch p // N."""
        n = len(self.prompts)
        orders: dict[int, list[int]] = {}
        out = []
        for p in range(start, start + count):
            epoch = p // n
            if epoch not in orders:
                orders[epoch] = self._epoch_order(epoch)
            out.append((epoch, orders[epoch][p % n]))
        return out

    def prompt_positions(self, rollout_id: int, batch_size: int) -> list[tuple[int, int]]:
        """(epoch, dataset index) of each prompt of a rollout that starts at position rollout_id x batch_size."""
        return self.stream_positions(rollout_id * batch_size, batch_size)

    def position(self, consumed: int) -> dict:
        """What a checkpoint saves once `consumed` prompts of the stream were taken."""
        n = len(self.prompts)
        return {"consumed": consumed, "epoch": consumed // n, "index": consumed % n, "num_prompts": n,
                "shuffle": self.shuffle, "seed": self.seed}

    def resume_at(self, saved: dict) -> tuple[int, list[str]]:
        """The stream position to continue from after a checkpoint's `position(...)`, and notes for the console.
        The saved shuffle seed is kept, so the current epoch's order is the one the saved run was taking."""
        notes = []
        if saved["shuffle"] != self.shuffle or (self.shuffle and saved["seed"] != self.seed):
            notes.append(f"the checkpoint's prompt order (shuffle {saved['shuffle']}, seed {saved['seed']}) is kept; "
                         f"--rollout-shuffle / --rollout-seed now ask for shuffle {self.shuffle}, seed {self.seed}")
            self.shuffle, self.seed = saved["shuffle"], saved["seed"]
        n = len(self.prompts)
        index = saved["index"]
        if saved["num_prompts"] != n:
            notes.append(f"the checkpoint's epoch had {saved['num_prompts']} prompts, --prompt-data now has {n}: "
                         f"continuing epoch {saved['epoch']} at index {min(index, n)}")
            index = min(index, n)
        return saved["epoch"] * n + index, notes

    def batch(self, rollout_id: int, batch_size: int, n_samples_per_prompt: int,
              start: int | None = None) -> list[Sample]:
        """`batch_size` prompts x `n_samples_per_prompt` samples, grouped by `group_index`; from stream position
        `start` (default: rollout_id x batch_size)."""
        if batch_size < 1 or n_samples_per_prompt < 1:
            raise ValueError(f"--rollout-batch-size={batch_size} and --n-samples-per-prompt="
                             f"{n_samples_per_prompt} must both be >= 1")
        start = rollout_id * batch_size if start is None else start
        samples = []
        for group, (epoch, idx) in enumerate(self.stream_positions(start, batch_size)):
            p = self.prompts[idx]
            for _ in range(n_samples_per_prompt):
                samples.append(Sample(index=len(samples), group_index=group, prompt=p.text, label=p.label,
                                      tokens=list(p.token_ids),
                                      metadata={"rollout_id": rollout_id, "prompt_index": idx, "epoch": epoch}))
        return samples
