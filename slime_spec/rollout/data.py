"""Prompt data: a JSONL file -> rollout batches of `Sample` groups.

A batch is a pure function of the rollout id (epochs wrap around, each epoch shuffled with
`rollout_seed + epoch` when `rollout_shuffle`), so a rollout can be regenerated or replayed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from slime_spec.rollout.sample import Sample


@dataclass(frozen=True)
class Prompt:
    text: str  # what the engine sees (chat template applied when asked)
    raw: str | list[dict]  # the input field as written in the file
    label: str | None
    token_ids: tuple[int, ...]


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-data {path}: no such file")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompt-data {path}:{lineno}: not valid JSON ({e})") from e
        if not isinstance(row, dict):
            raise ValueError(f"--prompt-data {path}:{lineno}: each line must be a JSON object, "
                             f"got {type(row).__name__}")
        rows.append(row)
    if not rows:
        raise ValueError(f"--prompt-data {path}: the file holds no prompts")
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
                 shuffle: bool = False, seed: int = 42):
        self.shuffle, self.seed = shuffle, seed
        self.prompts: list[Prompt] = []
        self.num_filtered = 0
        for i, row in enumerate(read_jsonl(path)):
            if input_key not in row:
                raise KeyError(f"--prompt-data {path}: line {i + 1} has no key {input_key!r} "
                               f"(keys: {sorted(row)}); set --input-key")
            if label_key is not None and label_key not in row:
                raise KeyError(f"--prompt-data {path}: line {i + 1} has no key {label_key!r} "
                               f"(keys: {sorted(row)}); set --label-key")
            text = render_prompt(row[input_key], tokenizer, apply_chat_template)
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if max_prompt_len is not None and len(ids) > max_prompt_len:
                self.num_filtered += 1
                continue
            label = None if label_key is None else row[label_key]
            self.prompts.append(Prompt(text, row[input_key], None if label is None else str(label), ids))
        if not self.prompts:
            raise ValueError(f"--prompt-data {path}: every prompt is longer than "
                             f"--rollout-max-prompt-len={max_prompt_len}")

    def __len__(self) -> int:
        return len(self.prompts)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def prompt_positions(self, rollout_id: int, batch_size: int) -> list[tuple[int, int]]:
        """(epoch, dataset index) of each prompt of a rollout; position p of the stream is epoch p // N."""
        n = len(self.prompts)
        orders: dict[int, list[int]] = {}
        out = []
        for p in range(rollout_id * batch_size, (rollout_id + 1) * batch_size):
            epoch = p // n
            if epoch not in orders:
                orders[epoch] = self._epoch_order(epoch)
            out.append((epoch, orders[epoch][p % n]))
        return out

    def batch(self, rollout_id: int, batch_size: int, n_samples_per_prompt: int) -> list[Sample]:
        """`batch_size` prompts x `n_samples_per_prompt` samples, grouped by `group_index`."""
        if batch_size < 1 or n_samples_per_prompt < 1:
            raise ValueError(f"--rollout-batch-size={batch_size} and --n-samples-per-prompt="
                             f"{n_samples_per_prompt} must both be >= 1")
        samples = []
        for group, (epoch, idx) in enumerate(self.prompt_positions(rollout_id, batch_size)):
            p = self.prompts[idx]
            for _ in range(n_samples_per_prompt):
                samples.append(Sample(index=len(samples), group_index=group, prompt=p.text, label=p.label,
                                      tokens=list(p.token_ids),
                                      metadata={"rollout_id": rollout_id, "prompt_index": idx, "epoch": epoch}))
        return samples
