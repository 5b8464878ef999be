"""Reading the final answer out of a model's completion: pure functions, no task state.

A chat model does not answer ``"46"`` on a line of its own; it writes ``"12 + 34 = 46. The answer is
\\boxed{46}."`` or a sentence ending in the number. Each *reader* below looks for one way of stating an
answer and returns its text, or None when the completion has none of that kind::

    first_line       "46\\nmore"                      -> "46"        (the bare format of the built-in model)
    boxed            "so \\boxed{\\frac{1}{2}}."        -> "\\frac{1}{2}" (the LAST complete, non-empty box)
    answer_tag       "<answer>(3+5)*2</answer>"       -> "(3+5)*2"   (the last one)
    hashes           "... #### 1,500"                 -> "1,500"     (GSM8K's reference format)
    last_number      "It costs $1,234.50 in total."   -> "1234.50"   (sign kept: "is -15" -> "-15")
    last_expression  "(3 + 5) * 2 = 16, done"         -> "(3 + 5) * 2" (the last span with an operator)
    last_grid        "1 2 3 4\\n3 4 1 2\\n..."           -> "12343412..." (16 digits 1-4: a 4x4 sudoku)

:func:`extract_answer` tries readers in order and returns what the first one found, so
``extract_answer(text, ("boxed", "last_number"))`` reads the last ``\\boxed{}`` and, without one, the
last number. :func:`normalize_answer` turns the text into an exact number for comparison
(``"$1,500."`` -> ``Fraction(1500)``, ``"\\frac{3}{4}"`` -> ``Fraction(3, 4)``), and
:func:`clean_expression` turns an expression as models write it (``"(3 + 5) \\times 2 = 16"``) into
the plain ASCII that :func:`ais_lightning.tasks.base.parse_expression` accepts. Every task reads its
completions through these functions (its ``extract`` option names the readers).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from fractions import Fraction

__all__ = [
    "READERS",
    "answer_tag",
    "boxed",
    "check_readers",
    "clean_expression",
    "extract_answer",
    "first_line",
    "hashes",
    "last_expression",
    "last_grid",
    "last_number",
    "normalize_answer",
]

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASHES_RE = re.compile(r"####([^\n]*)")
# A number as written in prose: thousands separated by commas (only in groups of exactly three digits, so a
# list "3,4,5" is three numbers), an optional decimal part, an optional "$" after the sign. A minus sign
# touching the digits belongs to the number unless it is an operator: right after a word character or a
# closing bracket ("10-3", "x-3"), or after a number or closing bracket and one space ("10 - 3"); the
# number is then 3. "is -3" and "= -3" keep the sign.
_TEXT_NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]}.])(?<![\d)\]}]\s)(?P<sign>-))?\$?(?P<body>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?"
)
_PLAIN_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_FRAC_ANY_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_UNICODE = {"\u2212": "-", "\u2013": "-", "\u00d7": "*", "\u22c5": "*", "\u00b7": "*", "\u00f7": "/"}
_LATEX_OPERATORS = {r"\times": "*", r"\cdot": "*", r"\ast": "*", r"\div": "/", r"\left": "", r"\right": ""}
_EXPRESSION_SPAN_RE = re.compile(r"[0-9+\-*/() ]+")
_OPERATOR_BETWEEN_NUMBERS_RE = re.compile(r"\d[\s)]*[+\-*/][\s(]*\d")
_GRID_RE = re.compile(r"[1-4](?:[\s,|]*[1-4]){15}")


def _ascii_math(text: str) -> str:
    """Unicode minus/times/divide signs as ``- * /``."""
    for src, dst in _UNICODE.items():
        text = text.replace(src, dst)
    return text


def first_line(text: str) -> str:
    """The text up to its first newline, stripped of surrounding whitespace (possibly ``""``)."""
    return text.split("\n", 1)[0].strip()


def _first_line_reader(text: str) -> str | None:
    """The ``first_line`` reader: :func:`first_line`, None when it is empty."""
    return first_line(text) or None


def boxed(text: str) -> str | None:
    """The content of the last complete, non-empty ``\\boxed{...}`` (or ``\\fbox{...}``), stripped.

    Braces nest: ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. A box never closed (a completion cut
    off inside it) and an empty box (``\\boxed{}``, e.g. the instruction repeated back) are skipped, so the
    last box that holds something is read. None without such a box.
    """
    found = None
    for match in _BOX_RE.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    content = text[start:i].strip()
                    if content:
                        found = content
                    break
    return found


def answer_tag(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>``, stripped (``""`` if that one is empty); None
    without one."""
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def hashes(text: str) -> str | None:
    """The rest of the line after the last ``####`` (GSM8K's final-answer marker), stripped; None without
    one."""
    found = _HASHES_RE.findall(text)
    return found[-1].strip() if found else None


def last_number(text: str) -> str | None:
    """The last number in the text as plain digits: ``$`` and thousands commas dropped, sign and decimals
    kept.

    ``"It costs $1,234.50."`` -> ``"1234.50"``; ``"12 - 34 = -22"`` -> ``"-22"``; ``"10-3"`` and ``"10 - 3"``
    -> ``"3"`` (a minus after a number is an operator); ``"1,2,3"`` -> ``"3"``; a final period is not a
    decimal point.
    None if the text has no digit.
    """
    found = None
    for match in _TEXT_NUMBER_RE.finditer(_ascii_math(text)):
        found = (
            (match.group("sign") or "") + match.group("body").replace(",", "") + (match.group("frac") or "")
        )
    return found


def clean_expression(text: str) -> str:
    """An arithmetic expression as a model may write it, in the ASCII :func:`parse_expression` reads.

    Unicode and LaTeX operators become ``* / -`` (``\\times``, ``\\cdot``, ``×``, ``÷``, ``−``),
    ``\\left`` and ``\\right`` go, ``\\frac{a}{b}`` becomes ``(a)/(b)`` and braces parentheses; of
    ``"lhs = rhs"`` the first side that holds an operator between two numbers is kept (``"(3+5)*2 = 16"``
    and ``"16 = (3+5)*2"`` both give ``"(3+5)*2"``); with no such side the text before the first ``=``.
    The result is stripped; it is not checked here.
    """
    text = _FRAC_ANY_RE.sub(r"(\1)/(\2)", _ascii_math(text))
    for src, dst in _LATEX_OPERATORS.items():
        text = text.replace(src, dst)
    text = text.replace("{", "(").replace("}", ")").replace("$", "")
    sides = text.split("=")
    for side in sides:
        if _OPERATOR_BETWEEN_NUMBERS_RE.search(side):
            return side.strip()
    return sides[0].strip()


def _balance(span: str) -> str:
    """``span`` without unmatched parentheses at its ends (a span cut out of prose: ``"(3+5)*2)"``)."""
    span = span.strip()
    while span.startswith("(") and span.count("(") > span.count(")"):
        span = span[1:].strip()
    while span.endswith(")") and span.count(")") > span.count("("):
        span = span[:-1].strip()
    return span


def last_expression(text: str) -> str | None:
    """The last span of the text made of digits, ``+ - * /``, parentheses and spaces that has an operator
    between two numbers, stripped and with unmatched end parentheses dropped; None without one.

    Operators are normalized first as in :func:`clean_expression`, and ``=`` ends a span, so
    ``"(3 + 5) \\times 2 = 16."`` gives ``"(3 + 5) * 2"`` (the claimed solution, not the target).
    """
    text = _ascii_math(text)
    for src, dst in _LATEX_OPERATORS.items():
        text = text.replace(src, dst)
    spans = [s for s in _EXPRESSION_SPAN_RE.findall(text) if _OPERATOR_BETWEEN_NUMBERS_RE.search(s)]
    return _balance(spans[-1]) if spans else None


def last_grid(text: str) -> str | None:
    """The last run of 16 digits from 1-4 (a 4x4 sudoku grid, row by row), separators allowed between the
    digits (spaces, newlines, commas, ``|``), as the 16 digits; None without one."""
    found = _GRID_RE.findall(text)
    return re.sub(r"[^1-4]", "", found[-1]) if found else None


READERS: dict[str, Callable[[str], str | None]] = {
    "first_line": _first_line_reader,
    "boxed": boxed,
    "answer_tag": answer_tag,
    "hashes": hashes,
    "last_number": last_number,
    "last_expression": last_expression,
    "last_grid": last_grid,
}
"""Every reader by name (a task's ``extract`` option lists some of these names)."""


def check_readers(names: Sequence[str] | None, field: str = "extract") -> tuple[str, ...] | None:
    """``names`` as a tuple after checking each is in :data:`READERS` (None stays None); ValueError naming
    ``field``."""
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise ValueError(
            f"{field} must be a non-empty list of reader names from {sorted(READERS)}, got {names!r}"
        )
    unknown = [n for n in names if n not in READERS]
    if unknown:
        raise ValueError(f"{field} has unknown reader(s) {unknown}; known readers: {sorted(READERS)}")
    return tuple(names)


def extract_answer(text: str, readers: Sequence[str] = ("boxed", "last_number")) -> str | None:
    """The answer of a completion: what the first of ``readers`` (names in :data:`READERS`) that finds one
    returns, else None. ``("boxed", "last_number")``: the last ``\\boxed{}``, else the last number."""
    for name in readers:
        try:
            reader = READERS[name]
        except KeyError:
            raise ValueError(f"unknown answer reader {name!r}; known readers: {sorted(READERS)}") from None
        found = reader(text)
        if found is not None:
            return found
    return None


def normalize_answer(text: str) -> Fraction | str:
    """An answer as an exact number when it is one, for comparing answers (the text cleaned otherwise).

    Removed first: commas, ``$``, spaces, a final ``.``, LaTeX spacing (``\\,`` ``\\!``), ``{,}`` thousands
    separators, ``\\%`` and ``%``; ``\\frac{a}{b}`` becomes ``a/b``. If the cleaned text is a number
    (``"-15"``, ``"2.50"``, ``"3/4"``) that number is returned; if it only contains numbers, the last one
    (``"72 apples"`` -> 72, ``"\\text{46}"`` -> 46); otherwise the cleaned string, for exact comparison.
    """
    text = _FRAC_RE.sub(r"\1/\2", _ascii_math(text))
    for junk in ("{,}", "\\,", "\\!", "\\%", "%", ",", "$", " "):
        text = text.replace(junk, "")
    cleaned = text.strip().rstrip(".")
    numbers = [cleaned] if _PLAIN_NUMBER_RE.fullmatch(cleaned) else _PLAIN_NUMBER_RE.findall(cleaned)
    if not numbers:
        return cleaned
    try:
        return Fraction(numbers[-1])
    except (ValueError, ZeroDivisionError):
        return cleaned
