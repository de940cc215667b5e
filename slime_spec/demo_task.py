"""The demo's synthetic task: multi-digit addition with a worked, digit-by-digit scratchpad.

A prompt is "347+589=" and the reference response works the sum column by column, then states it:

    ones: 7+9+0=16, write 6, carry 1
    tens: 4+8+1=13, write 3, carry 1
    hundreds: 3+5+1=9, write 9, carry 0
    answer: 936

Why this shape: responses of 70-110 tokens (a character-level tokenizer), mostly predictable
structure (what a draft model can learn to guess) around a few hard tokens (the digits), and a
checkable reward (`--rm-type scratchpad`: the last line's answer). The label is the whole reference
response, so the reward can also give partial credit for correct steps. Pure functions, deterministic by seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PLACES = ("ones", "tens", "hundreds", "thousands", "ten-thousands")
ANSWER_PREFIX = "answer: "


def worked_addition(a: int, b: int) -> str:
    """The reference scratchpad for a+b (non-negative), one line per column, the answer on the last line."""
    if a < 0 or b < 0:
        raise ValueError(f"worked_addition({a}, {b}): operands must be non-negative")
    da, db = str(a)[::-1], str(b)[::-1]
    columns = max(len(da), len(db))
    if columns > len(PLACES):
        raise ValueError(f"worked_addition({a}, {b}): at most {len(PLACES)} digits per operand")
    lines, carry = [], 0
    for i in range(columns):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        total = x + y + carry
        lines.append(f"{PLACES[i]}: {x}+{y}+{carry}={total}, write {total % 10}, carry {total // 10}")
        carry = total // 10
    lines.append(f"{ANSWER_PREFIX}{a + b}")
    return "\n".join(lines)


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def split_problems(n_train: int, n_eval: int, seed: int, digits: int = 3) -> tuple[list[dict], list[dict]]:
    """Disjoint train and eval problems a+b with both operands of exactly `digits` digits (eval never trains).

    Each row: {"prompt": "347+589=", "label": <the worked solution>, "answer": "936"}.
    """
    if not 1 <= digits <= len(PLACES):
        raise ValueError(f"digits={digits}: choose 1..{len(PLACES)}")
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10 ** digits - 1
    n_pool = (high - low + 1) ** 2
    if n_pool < n_train + n_eval:
        raise ValueError(f"only {n_pool} distinct problems with {digits}-digit operands; ask for fewer")
    width = high - low + 1
    picks = random.Random(seed).sample(range(n_pool), n_train + n_eval)  # without replacement, never materialized
    pairs = [(low + i // width, low + i % width) for i in picks]
    rows = [{"prompt": f"{a}+{b}=", "label": worked_addition(a, b), "answer": str(a + b)} for a, b in pairs]
    return rows[n_eval:], rows[:n_eval]
