import asyncio
import sys
import textwrap

import pytest

from slime_spec.config.run_config import RolloutConfig
from slime_spec.rollout.rewards import (
    RULES,
    assign_reward,
    exact_match_reward,
    extract_answer,
    make_reward_fn,
    math_reward,
    normalize_answer,
)
from slime_spec.rollout.sample import Sample, Status

# slime's rewards for realistic responses: each row's two rewards are what slime's own graders
# (slime/rollout/rm_hub: get_deepscaler_rule_based_reward, and grade_answer_verl for --rm-type math) returned
# for that response and label, run with sympy 1.14.0 and pylatexenc 2.10.
THOUGHT = "<think>\nLet me work this out step by step.\n</think>\n\n"
SLIME_REWARDS = [  # (response, label, slime's deepscaler reward, slime's math reward)
    (THOUGHT + 'The sum is $\\boxed{55}$.', '55', 1, 1),
    (THOUGHT + 'So the answer is \\boxed{55}', 55, 1, 1),
    ('The sum is $\\boxed{55}$.', '55', 0, 1),
    (THOUGHT + 'The sum of the first ten integers is 55.', '55', 0, 0),
    (THOUGHT + 'Answer: 55', '55', 0, 0),
    (THOUGHT + 'Therefore $x^2 = \\boxed{49}$.', '49', 1, 1),
    (THOUGHT + '$\\boxed{49.0}$', '49', 1, 1),
    (THOUGHT + '$\\boxed{48}$', '49', 0, 0),
    (THOUGHT + 'The value is $\\boxed{\\frac{\\sqrt{2}}{2}}$.', '\\frac{1}{\\sqrt{2}}', 1, 1),
    (THOUGHT + '$\\boxed{\\frac{\\sqrt2}{2}}$', '\\frac{1}{\\sqrt2}', 1, 1),
    (THOUGHT + 'Expanding gives $\\boxed{x^2+2x+1}$.', '(x+1)^2', 1, 1),
    (THOUGHT + '$\\boxed{(x+1)^2}$', 'x^2+2x+1', 1, 1),
    (THOUGHT + '$\\boxed{\\frac{1}{2}}$', '0.5', 1, 1),
    (THOUGHT + '$\\boxed{0.5}$', '\\frac{1}{2}', 1, 1),
    (THOUGHT + '$\\boxed{\\dfrac{3}{4}}$', '\\frac{3}{4}', 1, 1),
    (THOUGHT + '$\\boxed{3/4}$', '\\frac{3}{4}', 1, 1),
    (THOUGHT + '$\\boxed{6/8}$', '\\frac{3}{4}', 0, 0),
    (THOUGHT + '$\\boxed{\\frac{6}{8}}$', '\\frac{3}{4}', 0, 0),
    (THOUGHT + '$\\boxed{0.75}$', '\\frac{3}{4}', 1, 1),
    (THOUGHT + '$\\boxed{1,000}$', '1000', 1, 1),
    (THOUGHT + '$\\boxed{1000}$', '1,000', 1, 1),
    (THOUGHT + '$\\boxed{50\\%}$', '50', 1, 1),
    (THOUGHT + '$\\boxed{30^\\circ}$', '30', 1, 1),
    (THOUGHT + '$\\boxed{12 \\text{ cm}}$', '12', 1, 1),
    (THOUGHT + '$\\boxed{\\$18.90}$', '18.90', 1, 1),
    (THOUGHT + '$\\boxed{x = 3}$', '3', 1, 1),
    (THOUGHT + '$\\boxed{(1, 2)}$', '(1,2)', 1, 1),
    (THOUGHT + '$\\boxed{(1, 2]}$', '(1,2)', 0, 0),
    (THOUGHT + '$\\boxed{[-1, 3)}$', '[-1,3)', 1, 1),
    (THOUGHT + '$\\boxed{(2, 1)}$', '(1,2)', 0, 0),
    (THOUGHT + '$\\boxed{2\\pi}$', '2\\pi', 1, 1),
    (THOUGHT + '$\\boxed{6.28}$', '2\\pi', 0, 0),
    (THOUGHT + '$\\boxed{2\\sqrt{3}}$', '\\sqrt{12}', 1, 1),
    (THOUGHT + '$\\boxed{-7}$', '-7', 1, 1),
    (THOUGHT + '$\\boxed{- 7}$', '-7', 1, 1),
    (THOUGHT + '$\\boxed{7}$', '-7', 0, 0),
    (THOUGHT + 'First I get \\boxed{3}, but correcting: \\boxed{4}.', '4', 1, 1),
    (THOUGHT + 'First I get \\boxed{4}, but correcting: \\boxed{3}.', '4', 0, 0),
    (THOUGHT + '\\fbox{4}', '4', 0, 0),
    (THOUGHT + '\\boxed 4', '4', 0, 0),
    (THOUGHT + '\\boxed{4', '4', 0, 0),
    (THOUGHT + '$\\boxed{4}$', '\\boxed{4}', 1, 1),
    (THOUGHT + '$\\boxed{4}$', '', 0, 0),
    ('###Response\nThe answer is $\\boxed{9}$.', '9', 1, 1),
    ('Hmm. \\boxed{8}</think>Final: \\boxed{9}', '9', 1, 1),
    ('Hmm. \\boxed{9}</think>Final: the answer is 8', '9', 0, 1),
    (THOUGHT + '$\\boxed{\\text{Monday}}$', 'Monday', 1, 1),
    (THOUGHT + '$\\boxed{\\text{monday}}$', '\\text{Monday}', 1, 1),
    (THOUGHT + '$\\boxed{2 \\frac{1}{2}}$', '\\frac{5}{2}', 1, 1),
    (THOUGHT + '$\\boxed{\\frac{5}{2}}$', '2.5', 1, 1),
    (THOUGHT + '$\\boxed{10^{3}}$', '1000', 0, 0),
    (THOUGHT + '$\\boxed{1.5 \\times 10^3}$', '1500', 0, 0),
    (THOUGHT + '$\\boxed{\\sqrt{2}/2}$', '\\frac{\\sqrt{2}}{2}', 1, 1),
    (THOUGHT + '$\\boxed{\\{1, 2\\}}$', '\\{1,2\\}', 1, 1),
    (THOUGHT + '$\\boxed{3 \\text{ and } 5}$', '3, 5', 1, 1),
    (THOUGHT + '$\\boxed{y = 2x + 1}$', '2x+1', 1, 1),
    (THOUGHT + '$\\boxed{a+b}$', 'b+a', 1, 1),
    (THOUGHT + '$\\boxed{9}$', 9.0, 1, 1),
    (THOUGHT + '$\\boxed{2}$', 2, 1, 1),
    (THOUGHT + '$\\boxed{0}$', 0, 1, 0),
    (THOUGHT + '$\\boxed{\\frac{1}{3}}$', '0.333', 0, 0),
    (THOUGHT + '$\\boxed{11}$', '11 \\text{ pairs}', 1, 1),
    (THOUGHT + '$\\boxed{17}$', '\\boxed{17}', 1, 1),
    (THOUGHT + '', '5', 0, 0),
]


@pytest.mark.parametrize("response,label,deepscaler,math", SLIME_REWARDS)
def test_deepscaler_and_math_give_slimes_reward(response, label, deepscaler, math):
    assert RULES["deepscaler"](response, label) == deepscaler
    assert RULES["math"](response, label) == math


def test_slime_graders_need_a_label():
    for rm in ("deepscaler", "math"):
        with pytest.raises(ValueError, match="--label-key"):
            RULES[rm](THOUGHT + "\\boxed{1}", None)


@pytest.mark.parametrize("text,answer", [
    ("so we get \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("nested \\boxed{x^{2}+1} end", "x^{2}+1"),
    ("first \\boxed{3} then \\boxed{4}", "4"),
    ("The answer is 42.", "42"),
    ("we have 3 apples and 5 pears, 8", "8"),
    ("no number here", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("a,b", [
    ("1,000", "1000"), ("2.0", "2"), ("\\frac{1}{2}", "0.5"), ("\\dfrac{3}{6}", "1/2"), ("x = 3", "3"),
    ("$7$", "7"), ("50\\%", "50"), (" 12. ", "12"), ("\\frac12", "1/2"),
])
def test_normalize_equal(a, b):
    assert normalize_answer(a) == normalize_answer(b)


def test_normalize_different():
    assert normalize_answer("1/3") != normalize_answer("0.33")
    assert normalize_answer("x+1") != normalize_answer("x+2")


def test_lenient_math_reward():
    assert math_reward("thinking... \\boxed{1/2}", "0.5") == 1.0
    assert math_reward("the answer is 1,234", "1234") == 1.0
    assert math_reward("the answer is 7", "\\boxed{8}") == 0.0
    assert math_reward("nothing", "8") == 0.0
    with pytest.raises(ValueError, match="--label-key"):
        math_reward("1", None)


def test_exact_match():
    assert exact_match_reward(" abc\n", "abc") == 1.0
    assert exact_match_reward("abd", "abc") == 0.0


def _sample(response, label, status=Status.COMPLETED):
    return Sample(index=0, group_index=0, prompt="p", label=label, response=response, status=status)


def test_builtin_dispatch_and_aborted():
    for rm, response in (("math", "\\boxed{2}"), ("math_lenient", "2"), ("deepscaler", THOUGHT + "\\boxed{2}")):
        fn = make_reward_fn(RolloutConfig(hf_checkpoint="x", rm_type=rm))
        s = _sample(response, "2")
        asyncio.run(assign_reward(fn, s))
        assert s.reward == 1.0
    aborted = _sample("\\boxed{2}", "2", Status.ABORTED)
    asyncio.run(assign_reward(make_reward_fn(RolloutConfig(hf_checkpoint="x", rm_type="math")), aborted))
    assert aborted.reward == 0.0
    assert make_reward_fn(RolloutConfig(hf_checkpoint="x")) is None
    with pytest.raises(ValueError, match="--rm-type"):
        make_reward_fn(RolloutConfig(hf_checkpoint="x", rm_type="nope"))


def test_custom_rm(tmp_path, monkeypatch):
    (tmp_path / "my_rm.py").write_text(textwrap.dedent("""
        async def rm(args, sample):
            return len(sample.response) + args.rollout_max_response_len
        def plain(sample):
            return 0.25
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    s = _sample("abc", None)
    asyncio.run(assign_reward(make_reward_fn(RolloutConfig(hf_checkpoint="x", custom_rm_path="my_rm.rm")), s))
    assert s.reward == 3 + 64
    s = _sample("abc", None)
    asyncio.run(assign_reward(make_reward_fn(RolloutConfig(hf_checkpoint="x", custom_rm_path="my_rm.plain")), s))
    assert s.reward == 0.25
    with pytest.raises(AttributeError, match="--custom-rm-path"):
        make_reward_fn(RolloutConfig(hf_checkpoint="x", custom_rm_path="my_rm.missing"))
    sys.modules.pop("my_rm", None)


def test_scratchpad_is_a_registered_rm_type():
    from slime_spec.rollout.rewards import RM_TYPES
    assert "scratchpad" in RM_TYPES and "scratchpad_concise" in RM_TYPES
