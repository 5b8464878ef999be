"""Integer arithmetic: ``"12+34="`` -> ``"46"``.

The classic toy RL task for tiny models (e.g. the 2-digit addition warm-start in docs/design.md
section 5). Operands have between ``min_digits`` and ``digits`` digits; operators follow Python
precedence (``*`` binds tighter than ``+``/``-``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ais_lightning.tasks.base import (
    Task,
    TaskSample,
    check_aligned,
    evaluate_expression,
    first_line,
    parse_expression,
    parse_int,
    register_task,
)

MAX_REDRAWS = 1000
"""Draws before giving up on ``allow_negative=False``."""


@register_task("arithmetic")
@dataclass
class Arithmetic(Task):
    """Prompt ``"<a><op><b>...="``, solution the integer result; reward 1 on an exact match, else 0."""

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

    def __post_init__(self) -> None:
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
            if self.allow_negative or answer >= 0:
                return TaskSample(prompt=expr + "=", solution=str(answer), fields={"answer": answer})
        raise ValueError(
            f"no non-negative problem in {MAX_REDRAWS} draws; set allow_negative=True or change operators"
        )

    @staticmethod
    def answer_from_prompt(prompt: str) -> int:
        """The exact result of a prompt ``"<expression>="``; ValueError if it is not one."""
        if not prompt.endswith("="):
            raise ValueError(f"arithmetic prompt must end with '=', got {prompt!r}")
        return int(evaluate_expression(parse_expression(prompt[:-1])))

    def reward(
        self, prompts: list[str], completions: list[str], answer: list[int] | None = None, **fields: Any
    ) -> list[float]:
        """1.0 if the completion's first line (stripped) is exactly the integer answer, else 0.0.

        ``answer`` defaults to re-evaluating each prompt.
        """
        check_aligned(prompts, completions, answer=answer)
        golds = answer if answer is not None else [self.answer_from_prompt(p) for p in prompts]
        rewards = []
        for completion, gold in zip(completions, golds):
            value = parse_int(first_line(completion))
            rewards.append(1.0 if value is not None and value == int(gold) else 0.0)
        return rewards
