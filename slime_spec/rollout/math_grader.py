"""Math answer grading with slime's rules: `--rm-type deepscaler` and `--rm-type math` give slime's reward.

slime grades as DeepScaleR does (Hendrycks' MATH answer normalisation, then sympy): the answer is the content
of the response's last `\\boxed{...}`; it is right when it equals the label after MATH's string normalisation,
or when both, normalised again and read by sympy (LaTeX through pylatexenc), differ by zero. Integers must match
exactly, fractions as written, tuples element by element. `deepscaler` grades only what follows the last
`</think>` (or the first `###Response` section) and gives 0 to a response without either; `math` grades the
whole response. The rules here were written to give slime's reward; tests/test_rollout_rewards.py pins a table
of responses with the reward slime's own grader gave each.
"""

from __future__ import annotations

import re

THINK_END = "</think>"
RESPONSE_MARK = "###Response"


# ---- the answer ----

def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), else None.

    As slime: the last `\\boxed` (else `\\fbox`) is taken, and only the form `\\boxed{...}` gives an answer
    (`\\boxed 5`, `\\fbox{5}` or an unclosed brace give none)."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                whole = text[start:end + 1]
                return whole[len("\\boxed{"):-1] if whole.startswith("\\boxed{") else None
    return None


def boxed_answer(text: str) -> str | None:
    return last_boxed(text) if "\\boxed" in text else None


# ---- MATH's string normalisation (Hendrycks) ----

def _braced_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{7}` -> `\\frac{1}{7}`; a `\\frac` with fewer than two characters
    after it leaves the string as it was."""
    head, *parts = s.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if part[0] == "{":  # an empty part raises, as in MATH's code: the caller then keeps its input
            out += part
        elif len(part) < 2:
            return s
        elif part[1] != "{":
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            out += "{" + part[0] + "}" + part[1:]
    return out


def _slash_to_frac(s: str) -> str:
    """`3/4` (two integers written plainly) -> `\\frac{3}{4}`."""
    pieces = s.split("/")
    if len(pieces) != 2:
        return s
    try:
        num, den = int(pieces[0]), int(pieces[1])
    except ValueError:
        return s
    return f"\\frac{{{num}}}{{{den}}}" if s == f"{num}/{den}" else s


def _braced_sqrt(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`."""
    head, *parts = s.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts)


def _math_strip(s: str) -> str:
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:  # units written after the number
        pieces = s.split("\\text{ ")
        if len(pieces) != 2:
            raise ValueError("more than one unit")
        s = pieces[0]
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 3" -> "3"
        s = sides[1]
    s = _braced_sqrt(s).replace(" ", "")
    s = _braced_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def math_normalize(answer: str) -> str:
    answer = answer.strip()
    text = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
    if text is not None:
        answer = text.group("text").strip()
    try:
        return _math_strip(answer)
    except (IndexError, ValueError):
        return answer


def equal_as_written(given: str, truth: str) -> bool:
    return math_normalize(truth) == math_normalize(given)


# ---- the sympy reading ----

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard")
_SCALES = (("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"))
_TUPLE_CHARS = "()[]"
_SYMPY_UNSAFE = ("^{", "^(")  # sympy may run for a very long time on these: never equal
_SYMPY_UNSAFE_RE = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))


def _as_float(s: str) -> float | None:
    try:
        return float(s)
    except (ValueError, OverflowError):
        return None


def _near_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (ValueError, OverflowError):
        return False


def _drop_thousands_commas(s: str) -> str:
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
    while True:
        out = pattern.sub(r"\1\3\4", s)
        if out == s:
            return out
        s = out


def _is_integer_text(s: str) -> bool:
    x = _as_float(_drop_thousands_commas(s))
    return x is not None and _near_int(x)


def _latex_to_text(s: str) -> str:
    from pylatexenc import latex2text

    s = s.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    s = latex2text.LatexNodes2Text().latex_to_text(s)
    for symbol, name in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        s = s.replace(symbol, name)
    return s.strip()


def sympy_normalize(expr: str) -> str:
    text = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if text is not None:
        expr = text.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    for word, power in _SCALES:
        expr = expr.replace(word, power)
    for unit in _UNITS:
        expr = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    number = _as_float(expr)
    if number is not None and _near_int(number):
        expr = str(int(round(number)))
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        except Exception:  # pylatexenc refuses some inputs; the text stays as written, as in slime
            pass
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: 7 3/4 -> 7+3/4
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _is_integer_text(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _sympy_parse(expr: str):
    import sympy
    from sympy.parsing import sympy_parser

    names = {k: v for k, v in vars(sympy).items() if not k.startswith("_")}  # sympy's names, no builtins
    return sympy_parser.parse_expr(
        expr.replace("^", "**"), local_dict={}, global_dict={"__builtins__": {}, **names},
        transformations=sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,))


def _worth_evaluating(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    return (len(letters) <= 2 and not any(bad in expr for bad in _SYMPY_UNSAFE)
            and not any(r.search(expr) for r in _SYMPY_UNSAFE_RE))


def _sympy_equal(truth: str, given: str) -> bool:
    import sympy

    difference = f"({truth})-({given})"
    if not _worth_evaluating(difference):
        return False
    try:
        return sympy.simplify(_sympy_parse(difference)) == 0
    except Exception:  # an expression sympy cannot read is not equal to anything
        return False


def _elements(expr: str) -> list[str]:
    """A tuple or interval `(a,b)` / `[a,b)` as its elements; anything else as one element."""
    expr = _drop_thousands_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS \
            and not any(c in expr[1:-1] for c in _TUPLE_CHARS):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")


def _element_equal(truth: str, given: str) -> bool:
    if _FRACTION.search(truth) and _FRACTION.search(given):
        return truth == given  # an unreduced fraction is not the reduced one
    if _is_integer_text(truth) != _is_integer_text(given):
        return False  # an integer answer must be an integer
    return _sympy_equal(truth, given)


def equal_under_sympy(given: str, truth: str) -> bool:
    truth_n, given_n = sympy_normalize(truth), sympy_normalize(given)
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truths, givens = _elements(truth_n), _elements(given_n)
    if len(truths) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False  # open and closed intervals differ
    if len(truths) != len(givens):
        return False
    return all(_element_equal(t, g) for t, g in zip(truths, givens))


# ---- rewards ----

def label_answers(label) -> list[str]:
    """The label's answer: its boxed content when it has one, else the label as text (int labels too)."""
    text = str(label)
    if "\\boxed" in text:
        boxed = boxed_answer(text)
        return [] if boxed is None else [boxed]
    return [text]


def grade(answer: str | None, label) -> float:
    if answer is None or label is None or label == "":
        return 0.0
    return float(any(equal_as_written(answer, t) or equal_under_sympy(answer, t) for t in label_answers(label)))


def deepscaler_reward(response: str, label) -> float:
    """slime's `deepscaler`: the boxed answer after the last `</think>` (else in the first `###Response`
    section); 0 without either, without a boxed answer, or with an empty label."""
    if THINK_END in response:
        solution = response.split(THINK_END)[-1]
    elif RESPONSE_MARK in response:
        solution = response.split(RESPONSE_MARK)[1]
    else:
        return 0.0
    return grade(boxed_answer(solution), label)


def math_reward(response: str, label) -> float:
    """slime's `math`: the last boxed answer anywhere in the response against the label."""
    if not label:
        return 0.0
    return grade(boxed_answer(response), label)
