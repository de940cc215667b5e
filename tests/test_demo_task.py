import pytest

from slime_spec.demo_task import ANSWER_PREFIX, split_problems, worked_addition


def test_worked_addition_carries_column_by_column_and_ends_with_the_answer():
    assert worked_addition(347, 589).splitlines() == [
        "ones: 7+9+0=16, write 6, carry 1",
        "tens: 4+8+1=13, write 3, carry 1",
        "hundreds: 3+5+1=9, write 9, carry 0",
        "answer: 936",
    ]
    assert worked_addition(999, 1).splitlines()[-1] == "answer: 1000"
    assert worked_addition(5, 0) == "ones: 5+0+0=5, write 5, carry 0\nanswer: 5"


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
