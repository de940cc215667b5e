import re

import pytest

from slime_spec.demo.task import split_problems
from slime_spec.rollout.scratchpad import ANSWER_PREFIX, column_line, worked_addition


def test_terse_share_is_the_seeded_share_of_terse_parts():
    train, _ = split_problems(600, 0, seed=0, digits=3, terse_share=0.35)
    columns = [line for r in train for line in r["label"].splitlines()[:-1]]
    for part, terse in (("place", lambda line: not line[0].isalpha()), ("write", lambda line: " -> " in line),
                        ("carry", lambda line: re.search(r" c\d$", line) is not None)):
        share = sum(map(terse, columns)) / len(columns)
        assert 0.30 < share < 0.40, (part, share)
    assert train == split_problems(600, 0, seed=0, digits=3, terse_share=0.35)[0]
    assert all(line == column_line(*re.match(r"([a-z-]+): ", line).groups(), *map(int, re.findall(r"\d+", line)[:3]))
               for r in split_problems(50, 0, seed=0, digits=3)[0] for line in r["label"].splitlines()[:-1])
    with pytest.raises(ValueError, match="terse_share"):
        split_problems(5, 0, seed=0, terse_share=1.5)


def test_split_is_disjoint_deterministic_and_correct():
    train, evals = split_problems(800, 100, seed=0, digits=3)
    assert len(train) == 800 and len(evals) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    assert len({r["prompt"] for r in train}) == 800
    assert (train, evals) == split_problems(800, 100, seed=0, digits=3)
    for row in train + evals:
        a, b = row["prompt"].rstrip("=").split("+")
        assert len(a) == len(b) == 3
        assert int(row["answer"]) == int(a) + int(b)
        assert row["label"] == worked_addition(int(a), int(b))
        assert row["label"].splitlines()[-1] == ANSWER_PREFIX + row["answer"]


def test_responses_are_long_enough_for_speculation_to_matter():
    train, _ = split_problems(200, 0, seed=1, digits=3)
    lengths = [len(r["label"]) + 1 for r in train]  # one token per character, plus EOS
    assert 50 <= min(lengths) and max(lengths) <= 300


def test_asking_for_too_many_problems_is_an_error():
    with pytest.raises(ValueError, match="only 100 distinct problems"):
        split_problems(95, 10, seed=0, digits=1)
