"""The scratchpad format (columns in verbose or terse wording, the shortest solution) and its rewards."""

import pytest

from slime_spec.rollout.scratchpad import (
    SCRATCHPAD_CHAR_COST,
    SCRATCHPAD_MAX_LENGTH_COST,
    SCRATCHPAD_STEP_CREDIT,
    TERSE,
    VERBOSE,
    column_line,
    scratchpad_concise_reward,
    scratchpad_reward,
    step_facts,
    terse_solution,
    worked_addition,
)


def test_worked_addition_carries_column_by_column_and_ends_with_the_answer():
    assert worked_addition(347, 589).splitlines() == [
        "ones: 7+9+0=16, write 6, carry 1",
        "tens: 4+8+1=13, write 3, carry 1",
        "hundreds: 3+5+1=9, write 9, carry 0",
        "answer: 936",
    ]
    assert worked_addition(999, 1).splitlines()[-1] == "answer: 1000"
    assert worked_addition(5, 0) == "ones: 5+0+0=5, write 5, carry 0\nanswer: 5"


def test_each_part_of_a_column_can_be_written_tersely():
    assert column_line("ones", 7, 9, 0) == "ones: 7+9+0=16, write 6, carry 1"
    assert column_line("ones", 7, 9, 0, (True, False, False)) == "7+9+0=16, write 6, carry 1"
    assert column_line("ones", 7, 9, 0, (False, True, False)) == "ones: 7+9+0=16 -> 6, carry 1"
    assert column_line("ones", 7, 9, 0, (False, False, True)) == "ones: 7+9+0=16, write 6 c1"
    assert worked_addition(347, 589, [TERSE, VERBOSE, (False, False, True)]).splitlines() == [
        "7+9+0=16 -> 6 c1",
        "tens: 4+8+1=13, write 3, carry 1",
        "hundreds: 3+5+1=9, write 9 c0",
        "answer: 936",
    ]
    with pytest.raises(ValueError, match="2 styles for 3 columns"):
        worked_addition(347, 589, [TERSE] * 2)


def test_terse_solution_rewrites_every_column_and_keeps_the_answer():
    mixed = worked_addition(347, 589, [(True, False, True), VERBOSE, (False, True, False)])
    assert terse_solution(mixed) == worked_addition(347, 589, [TERSE] * 3)
    assert terse_solution("garbage\nanswer: 936") == "garbage\nanswer: 936"


def test_scratchpad_reward_checks_the_last_line_and_gives_partial_credit_for_steps():
    label = worked_addition(347, 589)
    assert scratchpad_reward(label, label) == 1.0
    assert scratchpad_reward("garbage\nanswer: 936", label) == 1.0  # the answer is what is checked
    wrong_answer = label.replace("answer: 936", "answer: 935")
    assert scratchpad_reward(wrong_answer, label) == pytest.approx(SCRATCHPAD_STEP_CREDIT)
    one_step = label.splitlines()[0] + "\nanswer: 1"
    assert scratchpad_reward(one_step, label) == pytest.approx(SCRATCHPAD_STEP_CREDIT / 3)
    assert scratchpad_reward("", label) == 0.0
    with pytest.raises(ValueError, match="--label-key"):
        scratchpad_reward("x", None)


def test_scratchpad_step_credit_is_the_same_in_either_wording():
    verbose = worked_addition(347, 589)
    terse = worked_addition(347, 589, [(True, True, True), (False, True, False), (True, False, True)])
    assert verbose != terse
    for a, b in zip(verbose.splitlines(), terse.splitlines()):
        assert step_facts(a) == step_facts(b)
    assert step_facts("ones: 7+9+0=16 -> 6 c1") != step_facts("ones: 7+9+0=16 -> 6 c0")
    wrong_answer = terse.replace("answer: 936", "answer: 935")
    assert scratchpad_reward(wrong_answer, verbose) == pytest.approx(SCRATCHPAD_STEP_CREDIT)


def test_scratchpad_concise_charges_for_length_past_the_terse_solution_but_never_prefers_a_wrong_answer():
    verbose = worked_addition(347, 589)
    terse = worked_addition(347, 589, [(True, True, True)] * 3)
    mixed = worked_addition(347, 589, [(True, False, False), (False, True, True), (True, True, True)])
    assert terse_solution(verbose) == terse_solution(mixed) == terse
    assert scratchpad_concise_reward(terse, mixed) == 1.0  # the label's own wording does not matter
    assert scratchpad_concise_reward(verbose, terse) == pytest.approx(
        1.0 - SCRATCHPAD_CHAR_COST * (len(verbose) - len(terse)))
    wrong = verbose.replace("answer: 936", "answer: 935")  # every step right, the answer wrong: partial credit, less
    assert scratchpad_concise_reward(wrong, verbose) == pytest.approx(
        SCRATCHPAD_STEP_CREDIT - SCRATCHPAD_CHAR_COST * (len(wrong) - len(terse)))
    assert scratchpad_concise_reward(terse, verbose) > scratchpad_concise_reward(mixed, verbose) \
        > scratchpad_concise_reward(verbose, verbose)
    long_and_right = "x" * 500 + "\n" + verbose
    assert scratchpad_concise_reward(long_and_right, verbose) == 1.0 - SCRATCHPAD_MAX_LENGTH_COST
    assert scratchpad_concise_reward(long_and_right, verbose) > SCRATCHPAD_STEP_CREDIT  # the best a wrong one gets
    assert scratchpad_concise_reward("x" * 500 + "\nanswer: 1", verbose) == -SCRATCHPAD_MAX_LENGTH_COST  # the floor
