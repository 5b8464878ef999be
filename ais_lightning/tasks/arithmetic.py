"""Integer arithmetic: ``"12+34="`` -> ``"46"``.

The classic toy RL task for tiny models (e.g. the 2-digit addition warm-start in docs/design.md
section 5). Operands have between ``min_digits`` and ``digits`` digits; operators follow Python
precedence (``*`` binds tighter than ``+``/``-``). In the chat format (``format="chat"``) the same
problem is asked in words and answered in prose::

    prompt:   "What is 12+34? Put the final answer in \\boxed{}."
    solution: "12 + 34 = 46. The answer is \\boxed{46}."

and the answer is read from the last ``\\boxed{}``, else the last number of the completion.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from ais_lightning.tasks.answers import normalize_answer
from ais_lightning.tasks.base import (
    ANSWER_INSTRUCTION,
    Task,
    TaskSample,
    check_aligned,
    check_format,
    evaluate_expression,
    parse_expression,
    parse_int,
)

MAX_REDRAWS = 1000
"""Draws before giving up on ``allow_negative=False``."""
_CHAT_PROMPT_RE = re.compile(r"What is ([0-9+\-* ]+)\? ")


def chat_prompt(expression: str) -> str:
    """The chat-format prompt: ``"What is 12+34? Put the final answer in \\boxed{}."``."""
    return f"What is {expression}? {ANSWER_INSTRUCTION}"


def chat_solution(expression: str, answer: int) -> str:
    """The chat-format reference solution: ``"12 + 34 = 46. The answer is \\boxed{46}."``."""
    spaced = re.sub(r"([+\-*])", r" \1 ", expression)
    return f"{spaced} = {answer}. The answer is \\boxed{{{answer}}}."


@dataclass
class Arithmetic(Task):
    """Prompt ``"<a><op><b>...="``, solution the integer result; reward 1 on an exact match, else 0.

    In the chat format: prompt ``"What is <a><op><b>...? Put the final answer in \\boxed{}."``, solution
    ``"<a> <op> <b> = <result>. The answer is \\boxed{<result>}."``, reward 1 if the number read equals it.
    """

    name: ClassVar[str] = "arithmetic"
    """Its name in the registry (``TASKS``) and in messages."""

    digits: int = 2
    """Maximum number of digits of each operand."""
    operators: str = "+"
    """Operators to draw from, any of ``"+-*"`` (e.g. ``"+-"``)."""
    min_digits: int | None = None
    """Minimum digits of each operand; None means ``digits`` (every operand has exactly ``digits`` digits)."""
    num_operands: int = 2
    """Operands per problem."""
    allow_negative: bool = True
    """If False, problems whose result is negative are redrawn."""
    format: str = "auto"
    """bare (``"12+34="`` -> ``"46"``), chat (asked in words, answered in ``\\boxed{}``) or auto (chat when
    the policy prompts through its chat template, set by ``ais-train``; bare otherwise)."""
    extract: list[str] | None = None
    """Answer readers tried in order (``ais_lightning.tasks.answers.READERS``); None: ``[first_line]`` in the
    bare format (the first line must be exactly the integer), ``[boxed, last_number]`` in the chat format
    (the number read is compared after removing ``$``, commas and LaTeX)."""

    def __post_init__(self) -> None:
        self.format, self.extract = check_format(self.format, self.extract)
        if self.digits < 1:
            raise ValueError(f"digits must be >= 1, got {self.digits}")
        if self.min_digits is None:
            self.min_digits = self.digits
        if not 1 <= self.min_digits <= self.digits:
            raise ValueError(f"min_digits must be in [1, digits={self.digits}], got {self.min_digits}")
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"operators must be a non-empty string over '+-*', got {self.operators!r}")
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")

    def _operand(self, rng: random.Random) -> int:
        n_digits = rng.randint(self.min_digits, self.digits)  # type: ignore[arg-type]
        low = 0 if n_digits == 1 else 10 ** (n_digits - 1)
        return rng.randint(low, 10**n_digits - 1)

    def sample(self, rng: random.Random) -> TaskSample:
        for _ in range(MAX_REDRAWS):
            expr = str(self._operand(rng))
            for _ in range(self.num_operands - 1):
                expr += rng.choice(self.operators) + str(self._operand(rng))
            answer = int(evaluate_expression(parse_expression(expr)))
            if not (self.allow_negative or answer >= 0):
                continue
            if self.chat_format:
                prompt, solution = chat_prompt(expr), chat_solution(expr, answer)
                return TaskSample(prompt=prompt, solution=solution, fields={"answer": answer})
            return TaskSample(prompt=expr + "=", solution=str(answer), fields={"answer": answer})
        raise ValueError(
            f"no non-negative problem in {MAX_REDRAWS} draws; set allow_negative=True or change operators"
        )

    @staticmethod
    def answer_from_prompt(prompt: str) -> int:
        """The exact result of a prompt ``"<expression>="`` or ``"What is <expression>? ..."``; ValueError
        if it is neither."""
        chat = _CHAT_PROMPT_RE.match(prompt)
        if chat is not None:
            return int(evaluate_expression(parse_expression(chat.group(1))))
        if not prompt.endswith("="):
            raise ValueError(f"arithmetic prompt must end with '=' or read 'What is ...? ', got {prompt!r}")
        return int(evaluate_expression(parse_expression(prompt[:-1])))

    def reward(
        self, prompts: list[str], completions: list[str], answer: list[int] | None = None, **fields: Any
    ) -> list[float]:
        """1.0 if the answer read from the completion is the integer answer, else 0.0.

        Bare format: the answer (by default the first line, stripped) must be exactly the integer. Chat
        format: the answer (by default the last ``\\boxed{}``, else the last number) must equal it as a
        number (``"$1,500"``, ``"46.0"`` count). ``answer`` defaults to re-evaluating each prompt.
        """
        check_aligned(prompts, completions, answer=answer)
        golds = answer if answer is not None else [self.answer_from_prompt(p) for p in prompts]
        rewards = []
        for completion, gold in zip(completions, golds):
            text = self.read_answer(completion)
            if text is None:
                rewards.append(0.0)
                continue
            value = normalize_answer(text) if self.chat_format else parse_int(text)
            rewards.append(1.0 if value is not None and value == int(gold) else 0.0)
        return rewards
