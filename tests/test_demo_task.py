from slime_spec.demo_task import split_problems


def test_split_is_disjoint_deterministic_and_correct():
    train, evals = split_problems(800, 100, seed=0, max_operand=29)
    assert len(train) == 800 and len(evals) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    assert (train, evals) == split_problems(800, 100, seed=0, max_operand=29)
    for row in train + evals:
        a, b = row["prompt"].rstrip("=").split("+")
        assert int(row["label"]) == int(a) + int(b) <= 58


def test_asking_for_too_many_problems_is_an_error():
    import pytest

    with pytest.raises(ValueError, match="only 100 distinct problems"):
        split_problems(95, 10, seed=0, max_operand=9)
