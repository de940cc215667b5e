"""The demo's synthetic task: multi-digit addition with a worked, digit-by-digit scratchpad.

A prompt is "347+589=" and the reference response works the sum column by column, then states it:

    ones: 7+9+0=16, write 6, carry 1
    tens: 4+8+1=13, write 3, carry 1
    hundreds: 3+5+1=9, write 9, carry 0
    answer: 936

Each of a column's three parts may also be written tersely (rollout/scratchpad.py, the format and its rewards),
so "7+9+0=16 -> 6 c1" is the tersest column. The demo's SFT data writes each part tersely about a third of the
time, by a seeded coin; its reward charges for length (`--rm-type scratchpad_concise`), so GRPO moves the policy
towards the terse parts, away from what a draft trained on the SFT outputs guesses at those points: the drift a
frozen draft falls behind.

Why this shape: responses of 50-110 tokens (a character-level tokenizer), mostly predictable
structure (what a draft model can learn to guess) around a few hard tokens (the digits), and a
checkable reward (`--rm-type scratchpad`: the last line's answer). The label is the whole reference
response, so the reward can also give partial credit for correct steps. Pure functions, deterministic by seed:
the problems and their split; the format is the scratchpad rewards' (rollout/scratchpad.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from slime_spec.rollout.scratchpad import PLACES, TERSE_PARTS, worked_addition


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
