"""Rewards: `--rm-type deepscaler | math | exact_match | math_lenient | scratchpad | scratchpad_concise` or a user
function (`--custom-rm-path`).

`deepscaler` and `math` are slime's graders under slime's names and give slime's reward for the same response and
label (rollout/math_grader.py). The others are slime-spec's own; the scratchpad ones, with the format they
grade, are in rollout/scratchpad.py.

A custom reward function is loaded by dotted path `package.module.function` and called once per
sample, after generation, with the finished `Sample` (prompt, response, label, tokens, status,
metadata, ...). Two signatures are accepted:

    async def rm(args: RolloutConfig, sample: Sample) -> float     # slime's signature
    def rm(sample: Sample) -> float                                # a plain function

`args` is the `RolloutConfig`. An aborted sample gets no reward call; its reward is 0.0.
"""

from __future__ import annotations

import importlib
import inspect
import re
from fractions import Fraction
from typing import Awaitable, Callable

from slime_spec.config.run_config import RolloutConfig
from slime_spec.rollout import math_grader
from slime_spec.rollout.sample import Sample, Status
from slime_spec.rollout.scratchpad import scratchpad_concise_reward, scratchpad_reward


def load_function(path: str, flag: str) -> Callable:
    """`pkg.module.fn` -> the function, with an error naming the flag."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{flag}={path!r}: expected a dotted path 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"{flag}={path!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise AttributeError(f"{flag}={path!r}: module {module_name!r} has no function {attr!r}")
    return fn


# ---- slime's math graders ----

def _need_label(rm_type: str, label) -> None:
    if label is None:
        raise ValueError(f"--rm-type {rm_type} needs a label: set --label-key to the answer field of --prompt-data")


def deepscaler_reward(response: str, label) -> float:
    """slime's `deepscaler`: the boxed answer after `</think>`, graded as slime grades (math_grader.py)."""
    _need_label("deepscaler", label)
    return math_grader.deepscaler_reward(response, label)


def slime_math_reward(response: str, label) -> float:
    """slime's `math`: the response's last boxed answer, graded as slime grades (math_grader.py)."""
    _need_label("math", label)
    return math_grader.math_reward(response, label)


# ---- slime-spec's lenient math checker (`math_lenient`) ----

def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        m = list(re.finditer(r"\\boxed\s+([^\s$]+)", text))
        return m[-1].group(1) if m else None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+?)(?:\.\s|\.?$|\n)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer: the last \\boxed{}, else 'the answer is X', else the last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    m = list(_ANSWER_IS.finditer(text))
    if m:
        return m[-1].group(1)
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _strip_latex(s: str) -> str:
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\[dt]?frac(\d)(\d)", r"\1/\2", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "$", "^\\circ", "^{\\circ}", "\\%", "%"):
        s = s.replace(token, "")
    return s


def normalize_answer(ans: str) -> str:
    """A canonical string: latex stripped, spaces/commas/trailing '.0' removed, numbers as reduced fractions."""
    s = _strip_latex(ans.strip())
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 3" -> "3"
    s = s.replace(" ", "")
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"^\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1/\2", s)
    try:
        if re.fullmatch(r"-?\d*\.?\d+(/-?\d*\.?\d+)?", s):
            num, _, den = s.partition("/")
            value = Fraction(num) / Fraction(den) if den else Fraction(num)
            return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    except (ValueError, ZeroDivisionError):
        return s
    return s


def math_reward(response: str, label: str | None) -> float:
    """`math_lenient`: 1.0 when the response's final answer (boxed, else 'the answer is X', else the last number)
    equals the label after normalisation, else 0.0. For models that do not box their answers."""
    if label is None:
        raise ValueError("--rm-type math_lenient needs a label: set --label-key to the answer field of --prompt-data")
    pred = extract_answer(response)
    if pred is None:
        return 0.0
    label = str(label)
    gold = _last_boxed(label) or label
    return float(normalize_answer(pred) == normalize_answer(gold))


def exact_match_reward(response: str, label: str | None) -> float:
    if label is None:
        raise ValueError("--rm-type exact_match needs a label and this sample has none: set --label-key to the "
                         "label field of --prompt-data")
    return float(response.strip() == str(label).strip())


RULES = {"deepscaler": deepscaler_reward, "math": slime_math_reward, "exact_match": exact_match_reward,
         "math_lenient": math_reward, "scratchpad": scratchpad_reward,
         "scratchpad_concise": scratchpad_concise_reward}
RM_TYPES = tuple(RULES)


# ---- dispatch ----

RewardFn = Callable[[Sample], Awaitable[float]]


def make_reward_fn(cfg: RolloutConfig) -> RewardFn | None:
    """The async reward function the rollout calls per sample, or None when no reward is configured."""
    if cfg.custom_rm_path:
        user_fn = load_function(cfg.custom_rm_path, "--custom-rm-path")
        n_params = len(inspect.signature(user_fn).parameters)

        async def custom(sample: Sample) -> float:
            out = user_fn(cfg, sample) if n_params >= 2 else user_fn(sample)
            if inspect.isawaitable(out):
                out = await out
            return float(out)
        return custom
    if cfg.rm_type is None:
        return None
    if cfg.rm_type not in RM_TYPES:
        raise ValueError(f"--rm-type={cfg.rm_type!r}: choose one of {RM_TYPES} or pass --custom-rm-path")
    rule = RULES[cfg.rm_type]

    async def builtin(sample: Sample) -> float:
        return rule(sample.response, sample.label)
    return builtin


async def assign_reward(reward_fn: RewardFn | None, sample: Sample) -> None:
    if reward_fn is None or sample.reward is not None:
        return
    sample.reward = 0.0 if sample.status == Status.ABORTED else await reward_fn(sample)
