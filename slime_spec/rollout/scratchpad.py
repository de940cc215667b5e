"""The worked-scratchpad format and its rewards (`--rm-type scratchpad | scratchpad_concise`).

A prompt is "347+589=" and a worked solution adds column by column, one line per column, the sum on the last
line:

    ones: 7+9+0=16, write 6, carry 1
    tens: 4+8+1=13, write 3, carry 1
    hundreds: 3+5+1=9, write 9, carry 0
    answer: 936

Each of a column's three parts may be written tersely, on its own: the place ("ones: " left out), the digit
written (" -> 6") and the carry (" c1"), so "7+9+0=16 -> 6 c1" is the tersest column. The label is the whole
reference solution, so the rewards can give partial credit for right steps in either wording and charge for
length past the tersest solution. The demo's task (demo/task.py) generates its data in this format.
"""

from __future__ import annotations

import re

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


SCRATCHPAD_STEP_CREDIT = 0.2
SCRATCHPAD_CHAR_COST = 0.008  # scratchpad_concise: per character past the shortest worked solution ...
SCRATCHPAD_MAX_LENGTH_COST = 0.5  # ... up to this, so a right answer (>= 0.5) always beats a wrong one (<= 0.2)


def step_facts(line: str) -> tuple[str, ...]:
    """What a scratchpad line states, whatever its wording: its numbers, in order ("ones: 7+9+0=16, write 6,
    carry 1" and "7+9+0=16 -> 6 c1" state the same; lines are compared at the same index, which names the place)."""
    return tuple(re.findall(r"\d+", line))


def scratchpad_reward(response: str, label: str | None) -> float:
    """A worked solution against the reference one (`label`: step lines, the answer on the last line).

    1.0 when the response's last line equals the label's (the final answer); otherwise partial credit,
    up to SCRATCHPAD_STEP_CREDIT, for the share of the label's step lines the response states at the
    same line, in either wording (`step_facts`): a signal for GRPO while few answers are right, never
    worth as much as a right answer.
    """
    if label is None:
        raise ValueError("--rm-type scratchpad needs the reference solution as label: set --label-key")
    want = label.strip().splitlines()
    got = response.strip().splitlines()
    if got and got[-1].strip() == want[-1].strip():
        return 1.0
    steps = want[:-1]
    if not steps:
        return 0.0
    right = sum(i < len(got) and step_facts(got[i]) == step_facts(step) for i, step in enumerate(steps))
    return SCRATCHPAD_STEP_CREDIT * right / len(steps)


def scratchpad_concise_reward(response: str, label: str | None) -> float:
    """`scratchpad_reward` less a length penalty, as RL runs that want concise reasoning add: SCRATCHPAD_CHAR_COST
    per character past the shortest worked solution of the problem (terse_solution), at most
    SCRATCHPAD_MAX_LENGTH_COST, so a right answer of any length beats a wrong one. The reward lies in [-0.5, 1]:
    a long wrong answer pays for its length too (scaling the reward down instead, so that it stayed in [0, 1],
    left wrong answers, most samples early on, almost no length signal, and the policy's wording did not move
    in the demo's 20 steps)."""
    base = scratchpad_reward(response, label)
    extra = max(0, len(response.strip()) - len(terse_solution(label)))
    return base - min(SCRATCHPAD_MAX_LENGTH_COST, SCRATCHPAD_CHAR_COST * extra)
