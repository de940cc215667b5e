"""The demo's synthetic task: multi-digit addition with a worked, digit-by-digit scratchpad.

A prompt is "347+589=" and the reference response works the sum column by column, then states it:

    ones: 7+9+0=16, write 6, carry 1
    tens: 4+8+1=13, write 3, carry 1
    hundreds: 3+5+1=9, write 9, carry 0
    answer: 936

Each of a column's three parts may also be written tersely, on its own: the place ("ones: " left out),
the digit written (" -> 6") and the carry (" c1"), so "7+9+0=16 -> 6 c1" is the tersest column. The demo's
SFT data writes each part tersely about a third of the time, by a seeded coin; its reward charges for length
(`--rm-type scratchpad_concise`), so GRPO moves the policy towards the terse parts, away from what a draft
trained on the SFT outputs guesses at those points: the drift a frozen draft falls behind.

Why this shape: responses of 50-110 tokens (a character-level tokenizer), mostly predictable
structure (what a draft model can learn to guess) around a few hard tokens (the digits), and a
checkable reward (`--rm-type scratchpad`: the last line's answer). The label is the whole reference
response, so the reward can also give partial credit for correct steps. Pure functions, deterministic by seed.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

PLACES = ("ones", "tens", "hundreds", "thousands", "ten-thousands")
ANSWER_PREFIX = "answer: "


TERSE_PARTS = ("place", "write", "carry")  # the parts of a column that can be written tersely
Style = tuple[bool, bool, bool]  # per part of TERSE_PARTS: terse or not
VERBOSE: Style = (False, False, False)
TERSE: Style = (True, True, True)


def column_line(place: str, x: int, y: int, carry: int, style: Style = VERBOSE) -> str:
    """One column of the scratchpad, each part (TERSE_PARTS) verbose or terse as `style` says."""
    terse_place, terse_write, terse_carry = style
    total = x + y + carry
    head = "" if terse_place else f"{place}: "
    write = f" -> {total % 10}" if terse_write else f", write {total % 10}"
    carry_out = f" c{total // 10}" if terse_carry else f", carry {total // 10}"
    return f"{head}{x}+{y}+{carry}={total}{write}{carry_out}"


def worked_addition(a: int, b: int, styles: list[Style] | None = None) -> str:
    """The reference scratchpad for a+b (non-negative), one line per column, the answer on the last line.

    `styles[i]`: column i's style (column_line); None writes every column verbosely.
    """
    if a < 0 or b < 0:
        raise ValueError(f"worked_addition({a}, {b}): operands must be non-negative")
    da, db = str(a)[::-1], str(b)[::-1]
    columns = max(len(da), len(db))
    if columns > len(PLACES):
        raise ValueError(f"worked_addition({a}, {b}): at most {len(PLACES)} digits per operand")
    styles = styles or [VERBOSE] * columns
    if len(styles) != columns:
        raise ValueError(f"worked_addition({a}, {b}): {len(styles)} styles for {columns} columns")
    lines, carry = [], 0
    for i in range(columns):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        lines.append(column_line(PLACES[i], x, y, carry, styles[i]))
        carry = (x + y + carry) // 10
    lines.append(f"{ANSWER_PREFIX}{a + b}")
    return "\n".join(lines)


def terse_solution(label: str) -> str:
    """The label's scratchpad with every column written tersely: the shortest worked solution of its problem
    (a line that is not a column, such as the answer, is kept as it is)."""
    lines = []
    for line in label.strip().splitlines():
        numbers = [int(n) for n in re.findall(r"\d+", line)]
        is_column = (not line.startswith(ANSWER_PREFIX) and len(numbers) == 6
                     and numbers[0] + numbers[1] + numbers[2] == numbers[3])
        lines.append(column_line("", *numbers[:3], TERSE) if is_column else line)
    return "\n".join(lines)


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def split_problems(n_train: int, n_eval: int, seed: int, digits: int = 3,
                   terse_share: float = 0.0) -> tuple[list[dict], list[dict]]:
    """Disjoint train and eval problems a+b with both operands of exactly `digits` digits (eval never trains).

    Each row: {"prompt": "347+589=", "label": <the worked solution>, "answer": "936"}. Each part of each
    column of a label is terse with probability `terse_share` (seeded).
    """
    if not 1 <= digits <= len(PLACES):
        raise ValueError(f"digits={digits}: choose 1..{len(PLACES)}")
    if not 0.0 <= terse_share <= 1.0:
        raise ValueError(f"terse_share={terse_share}: choose a probability in [0, 1]")
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10 ** digits - 1
    n_pool = (high - low + 1) ** 2
    if n_pool < n_train + n_eval:
        raise ValueError(f"only {n_pool} distinct problems with {digits}-digit operands; ask for fewer")
    width = high - low + 1
    rng = random.Random(seed)
    picks = rng.sample(range(n_pool), n_train + n_eval)  # without replacement, never materialized
    pairs = [(low + i // width, low + i % width) for i in picks]
    styles = [[tuple(rng.random() < terse_share for _ in TERSE_PARTS) for _ in range(digits)] for _ in pairs]
    rows = [{"prompt": f"{a}+{b}=", "label": worked_addition(a, b, style), "answer": str(a + b)}
            for (a, b), style in zip(pairs, styles)]
    return rows[n_eval:], rows[:n_eval]
