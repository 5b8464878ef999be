"""Countdown: reach a target from a few numbers with ``+ - * /``, each number used at most once.

The reasoning-gym task of TinyZero (Pan et al. 2025) with the reward shape of its rule-based
scorer: 1.0 for a correct equation, 0.1 for a well-formed but wrong one, 0 otherwise. The prompt
is kept short for a tiny character-level model::

    prompt:   "3 5 2>16:"               numbers separated by spaces, ">", the target, ":"
    solution: "<answer>(3+5)*2</answer>"

Completions are never ``eval``-ed: the text inside the last ``<answer>...</answer>`` is parsed by
:func:`~ais_lightning.tasks.base.parse_expression` (integers, ``+ - * /``, parentheses only) and
evaluated exactly with fractions.

In the chat format (``format="chat"``) the same problem is asked in words::

    prompt:   "Using the numbers 3, 5 and 2, write an arithmetic expression that equals 16. You may use
               + - * / and parentheses, each number at most once. Put the final expression in \\boxed{}."
    solution: "(3+5)*2 = 16. The answer is \\boxed{(3+5)*2}."

and the expression is read from the last ``\\boxed{}``, else the last ``<answer>...</answer>``, else the
last expression-like span of the completion (digits, ``+ - * /``, parentheses: ``"so (3 + 5) * 2 = 16"``
gives ``(3 + 5) * 2``). The box is what chat models are trained to put final answers in, the tags are
TinyZero's countdown convention (and this task's bare format); a model that states the equation in prose
without either still has its expression read, and since the reward checks the numbers and the value
itself, reading leniently never turns a wrong expression into a right one. What is read is cleaned
(``\\times``, ``×``, ``\\div``, ``÷`` become ``* /``; of ``"expr = 16"`` the side with the operators is
kept, :func:`~ais_lightning.tasks.answers.clean_expression`) before it is parsed.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from ais_lightning.tasks.answers import answer_tag, clean_expression
from ais_lightning.tasks.base import (
    Task,
    TaskSample,
    check_aligned,
    check_format,
    evaluate_expression,
    expression_numbers,
    parse_expression,
)

_PROMPT_RE = re.compile(r"^(\d+(?: \d+)*)>(\d+):$")
_CHAT_PROMPT_RE = re.compile(
    r"^Using the numbers ([\d, and]+), write an arithmetic expression that equals (\d+)\."
)
MAX_REDRAWS = 1000
"""Number draws before giving up on finding a reachable target."""


def reachable_values(numbers: list[int]) -> dict[int, dict[int, str]]:
    """Non-negative integers reachable from each subset of ``numbers`` (each used at most once), with one expression.

    Dynamic programming over subset bitmasks, with the intermediate results of the Countdown game
    (non-negative integers, exact division only): the values of a subset are its single number, or
    ``a op b`` with ``a`` from one part of a split into two non-empty parts and ``b`` from the other.
    Returns ``{bitmask: {value: expression}}``; compound sub-expressions are parenthesized.
    The reward accepts any correct equation, fractions included; this only finds targets and solutions.
    """
    n = len(numbers)
    table: dict[int, dict[int, str]] = {1 << i: {x: str(x)} for i, x in enumerate(numbers)}
    for mask in sorted(range(1, 1 << n), key=lambda m: (bin(m).count("1"), m)):
        if mask in table:
            continue
        values: dict[int, str] = {}
        sub = (mask - 1) & mask
        while sub:
            other = mask ^ sub
            for a, ea in table[sub].items():
                pa = ea if (sub & (sub - 1)) == 0 else f"({ea})"
                for b, eb in table[other].items():
                    pb = eb if (other & (other - 1)) == 0 else f"({eb})"
                    if sub < other:  # + and * are symmetric: one order of the split is enough
                        values.setdefault(a + b, f"{pa}+{pb}")
                        values.setdefault(a * b, f"{pa}*{pb}")
                    if a >= b:
                        values.setdefault(a - b, f"{pa}-{pb}")
                    if b and a % b == 0:
                        values.setdefault(a // b, f"{pa}/{pb}")
            sub = (sub - 1) & mask
        table[mask] = values
    return table


def chat_prompt(numbers: list[int], target: int) -> str:
    """The chat-format prompt of a problem (see the module docstring)."""
    listed = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    return (
        f"Using the numbers {listed}, write an arithmetic expression that equals {target}. You may use "
        "+ - * / and parentheses, each number at most once. Put the final expression in \\boxed{}."
    )


def parse_countdown_prompt(prompt: str) -> tuple[list[int], int]:
    """``(numbers, target)`` of a prompt ``"3 5 2>16:"`` or of its chat form; ValueError if malformed."""
    chat = _CHAT_PROMPT_RE.match(prompt)
    if chat is not None:
        return [int(x) for x in re.findall(r"\d+", chat.group(1))], int(chat.group(2))
    match = _PROMPT_RE.match(prompt)
    if match is None:
        raise ValueError(
            "countdown prompt must look like '3 5 2>16:' or 'Using the numbers 3, 5 and 2, ...', "
            f"got {prompt!r}"
        )
    return [int(x) for x in match.group(1).split()], int(match.group(2))


def expression_score(
    expression: str | None, numbers: list[int], target: int, format_score: float = 0.1
) -> float:
    """1.0 if ``expression`` (plain ASCII, see :func:`~ais_lightning.tasks.base.parse_expression`) equals
    ``target`` using ``numbers`` at most once each, ``format_score`` if it parses but is wrong (value,
    reused/foreign numbers, division by zero), else 0 (also for None: no expression found)."""
    if expression is None:
        return 0.0
    try:
        tree = parse_expression(expression)
    except ValueError:
        return 0.0
    if Counter(expression_numbers(tree)) - Counter(numbers):
        return format_score
    try:
        value = evaluate_expression(tree)
    except ZeroDivisionError:
        return format_score
    return 1.0 if value == target else format_score


def countdown_score(completion: str, numbers: list[int], target: int, format_score: float = 0.1) -> float:
    """The bare format's score: :func:`expression_score` of the last ``<answer>...</answer>`` as written."""
    return expression_score(answer_tag(completion), numbers, target, format_score)


@dataclass
class Countdown(Task):
    """Prompt ``"3 5 2>16:"``, solution ``"<answer>(3+5)*2</answer>"`` (found by exhaustive search)."""

    name: ClassVar[str] = "countdown"
    """Its name in the registry (``TASKS``) and in messages."""

    num_numbers: int = 3
    """How many numbers are given (2..5; the search is exhaustive)."""
    max_number: int = 10
    """Numbers are drawn uniformly from ``[min_number, max_number]``."""
    min_number: int = 1
    """Smallest number that can be drawn."""
    max_target: int = 100
    """Targets are reachable positive integers up to this."""
    use_all: bool = False
    """If True, targets must be reachable using every number (the solution uses all of them)."""
    format_score: float = 0.1
    """Reward of a well-formed but wrong answer."""
    format: str = "auto"
    """bare (``"3 5 2>16:"`` -> ``"<answer>(3+5)*2</answer>"``), chat (asked in words, the expression in
    ``\\boxed{}``) or auto (chat when the policy prompts through its chat template, set by ``ais-train``)."""
    extract: list[str] | None = None
    """Answer readers tried in order (``ais_lightning.tasks.answers.READERS``); None: ``[answer_tag]`` in the
    bare format (parsed as written), ``[boxed, answer_tag, last_expression]`` in the chat format (cleaned by
    ``clean_expression`` first)."""

    BARE_READERS = ("answer_tag",)
    CHAT_READERS = ("boxed", "answer_tag", "last_expression")

    def __post_init__(self) -> None:
        self.format, self.extract = check_format(self.format, self.extract)
        if not 2 <= self.num_numbers <= 5:
            raise ValueError(f"num_numbers must be in [2, 5], got {self.num_numbers}")
        if not 0 <= self.min_number <= self.max_number:
            raise ValueError(f"need 0 <= min_number <= max_number, got {self.min_number}, {self.max_number}")
        if self.max_target < 1:
            raise ValueError(f"max_target must be >= 1, got {self.max_target}")
        if not 0 <= self.format_score < 1:
            raise ValueError(f"format_score must be in [0, 1), got {self.format_score}")

    def sample(self, rng: random.Random) -> TaskSample:
        full = (1 << self.num_numbers) - 1
        for _ in range(MAX_REDRAWS):
            numbers = [rng.randint(self.min_number, self.max_number) for _ in range(self.num_numbers)]
            table = reachable_values(numbers)
            masks = [full] if self.use_all else [m for m in table if m & (m - 1)]  # >= 2 numbers
            solutions: dict[int, str] = {}
            for mask in sorted(masks):
                for value, expr in table[mask].items():
                    if 1 <= value <= self.max_target and value not in numbers:
                        solutions.setdefault(value, expr)
            if solutions:
                target = rng.choice(sorted(solutions))
                expr = solutions[target]
                if self.chat_format:
                    prompt = chat_prompt(numbers, target)
                    solution = f"{expr} = {target}. The answer is \\boxed{{{expr}}}."
                else:
                    prompt = f"{' '.join(map(str, numbers))}>{target}:"
                    solution = f"<answer>{expr}</answer>"
                return TaskSample(prompt, solution, {"numbers": numbers, "target": target})
        raise ValueError(
            f"no reachable target in [1, {self.max_target}] after {MAX_REDRAWS} draws of numbers"
        )

    def reward(
        self,
        prompts: list[str],
        completions: list[str],
        numbers: list[list[int]] | None = None,
        target: list[int] | None = None,
        **fields: Any,
    ) -> list[float]:
        """:func:`expression_score` of the expression read (see ``extract``); ``numbers``/``target``
        default to parsing each prompt."""
        check_aligned(prompts, completions, numbers=numbers, target=target)
        rewards = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            nums, tgt = parse_countdown_prompt(prompt) if numbers is None or target is None else (None, None)
            nums = list(numbers[i]) if numbers is not None else nums
            tgt = int(target[i]) if target is not None else tgt
            expression = self.read_answer(completion)
            if expression is not None and self.chat_format:
                expression = clean_expression(expression)
            score = expression_score(expression, nums, tgt, self.format_score)  # type: ignore[arg-type]
            rewards.append(score)
        return rewards
