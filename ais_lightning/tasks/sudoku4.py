"""4x4 sudoku (digits 1-4; every row, column and 2x2 box holds each digit once).

Grids are strings of 16 characters in row-major order. The prompt is the puzzle with ``"."`` for
empty cells followed by ``":"``; the solution is the 16 digits::

    prompt:   "1.3..4.1.1..4.2.:"
    solution: "1234341221434321"

Reward (partial credit, as in reasoning-gym's puzzle scorers): the fraction of empty cells whose
digit is right, where "right" means it matches the reference solution, unless the completion is a
complete valid grid that keeps every clue, which scores 1.0 (so a different valid solution of a
non-unique puzzle is not penalized). A first line that is not exactly 16 digits 1-4 scores 0.

In the chat format (``format="chat"``) the puzzle is shown as four rows under an instruction::

    prompt:   "Solve this 4x4 sudoku: fill each . with a digit from 1 to 4 so that every row, column and
               2x2 box holds each digit once.\\n.2..\\n.34.\\n2413\\n3.24\\nPut the final answer, the 16
               digits of the solved grid row by row, in \\boxed{}."
    solution: "4231\\n1342\\n2413\\n3124\\nThe answer is \\boxed{4231134224133124}."

The grid is read from the last ``\\boxed{}`` (its digits, whatever separates them), else the last run of
16 digits 1-4 in the completion (spaces, newlines, commas or ``|`` between them), and scored as above.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from ais_lightning.tasks.base import Task, TaskSample, check_aligned, check_format, first_line

DIGITS = "1234"
_UNITS = (
    [[4 * r + c for c in range(4)] for r in range(4)]  # rows
    + [[4 * r + c for r in range(4)] for c in range(4)]  # columns
    + [[4 * (br + r) + bc + c for r in range(2) for c in range(2)] for br in (0, 2) for bc in (0, 2)]  # boxes
)
_PEERS = [sorted({j for unit in _UNITS if i in unit for j in unit} - {i}) for i in range(16)]
MAX_REDRAWS = 200
"""Grids tried before giving up on a requested number of empty cells with a unique solution."""
_CHAT_GRID_RE = re.compile(r"^([1-4.]{4})\n([1-4.]{4})\n([1-4.]{4})\n([1-4.]{4})$", re.MULTILINE)


def chat_prompt(puzzle: str) -> str:
    """The chat-format prompt of a 16-character puzzle (see the module docstring)."""
    rows = "\n".join(puzzle[4 * r : 4 * r + 4] for r in range(4))
    return (
        "Solve this 4x4 sudoku: fill each . with a digit from 1 to 4 so that every row, column and 2x2 box "
        f"holds each digit once.\n{rows}\nPut the final answer, the 16 digits of the solved grid row by row, "
        "in \\boxed{}."
    )


def chat_solution(solution: str) -> str:
    """The chat-format reference solution of a solved grid: its rows, then the 16 digits in ``\\boxed{}``."""
    rows = "\n".join(solution[4 * r : 4 * r + 4] for r in range(4))
    return f"{rows}\nThe answer is \\boxed{{{solution}}}."


def is_valid_grid(grid: str) -> bool:
    """True if ``grid`` is 16 digits 1-4 with every row, column and 2x2 box a permutation of 1-4."""
    return (
        len(grid) == 16 and set(grid) <= set(DIGITS) and all(len({grid[i] for i in u}) == 4 for u in _UNITS)
    )


def solve(puzzle: str, limit: int = 2) -> list[str]:
    """Up to ``limit`` solutions of a 16-character puzzle (``"."`` = empty), by backtracking."""
    if len(puzzle) != 16 or set(puzzle) - set(DIGITS + "."):
        raise ValueError(f"puzzle must be 16 characters from '1234.', got {puzzle!r}")
    cells = list(puzzle)
    for i, ch in enumerate(cells):  # clues that clash can have no solution
        if ch != "." and any(cells[j] == ch for j in _PEERS[i]):
            return []
    solutions: list[str] = []

    def backtrack() -> None:
        if len(solutions) >= limit:
            return
        if "." not in cells:
            solutions.append("".join(cells))
            return
        i = cells.index(".")
        for d in DIGITS:
            if all(cells[j] != d for j in _PEERS[i]):
                cells[i] = d
                backtrack()
                cells[i] = "."

    backtrack()
    return solutions


def random_grid(rng: random.Random) -> str:
    """A random solved 4x4 grid (backtracking with a random digit order in every cell)."""
    cells = ["."] * 16

    def fill(i: int) -> bool:
        if i == 16:
            return True
        for d in rng.sample(DIGITS, 4):
            if all(cells[j] != d for j in _PEERS[i]):
                cells[i] = d
                if fill(i + 1):
                    return True
        cells[i] = "."
        return False

    fill(0)
    return "".join(cells)


def sudoku_score(completion: str, puzzle: str, solution: str) -> float:
    """The bare format's score: :func:`grid_score` of the completion's first line (stripped)."""
    return grid_score(first_line(completion), puzzle, solution)


def grid_score(guess: str, puzzle: str, solution: str) -> float:
    """Fraction of the puzzle's empty cells ``guess`` fills correctly, 1.0 for any valid grid that keeps the
    clues, 0 unless ``guess`` is exactly 16 digits 1-4 (see the module docstring)."""
    if len(guess) != 16 or set(guess) - set(DIGITS):
        return 0.0
    empty = [i for i, ch in enumerate(puzzle) if ch == "."]
    if not empty:
        return 1.0
    keeps_clues = all(p == "." or p == g for p, g in zip(puzzle, guess))
    if keeps_clues and is_valid_grid(guess):
        return 1.0
    return sum(guess[i] == solution[i] for i in empty) / len(empty)


@dataclass
class Sudoku4(Task):
    """4x4 sudoku: prompt the puzzle (16 chars, ``"."`` empty) and ``":"``, solution the 16 digits."""

    name: ClassVar[str] = "sudoku4"
    """Its name in the registry (``TASKS``) and in messages."""

    empty_cells: int = 8
    """Empty cells per puzzle (1..12 with ``unique``; 4x4 puzzles with a unique solution have >= 4 clues)."""
    unique: bool = True
    """Only emit puzzles with exactly one solution (cells are emptied while that stays true)."""
    format: str = "auto"
    """bare (``"1.3..4.1.1..4.2.:"`` -> the 16 digits), chat (the grid in rows under an instruction, the
    answer in ``\\boxed{}``) or auto (chat when the policy prompts through its chat template, set by
    ``ais-train``; bare otherwise)."""
    extract: list[str] | None = None
    """Answer readers tried in order (``ais_lightning.tasks.answers.READERS``); None: ``[first_line]`` in the
    bare format (exactly the 16 digits), ``[boxed, last_grid]`` in the chat format (the digits of what is
    read)."""

    CHAT_READERS = ("boxed", "last_grid")

    def __post_init__(self) -> None:
        self.format, self.extract = check_format(self.format, self.extract)
        top = 12 if self.unique else 16
        if not 1 <= self.empty_cells <= top:
            raise ValueError(
                f"empty_cells must be in [1, {top}] (unique={self.unique}), got {self.empty_cells}"
            )

    def sample(self, rng: random.Random) -> TaskSample:
        for _ in range(MAX_REDRAWS):
            solution = random_grid(rng)
            cells = list(solution)
            removed = 0
            for i in rng.sample(range(16), 16):
                if removed == self.empty_cells:
                    break
                cells[i] = "."
                if self.unique and len(solve("".join(cells))) != 1:
                    cells[i] = solution[i]
                else:
                    removed += 1
            if removed == self.empty_cells:
                puzzle = "".join(cells)
                if self.chat_format:
                    prompt, text = chat_prompt(puzzle), chat_solution(solution)
                    return TaskSample(prompt=prompt, solution=text, fields={"answer": solution})
                return TaskSample(prompt=puzzle + ":", solution=solution, fields={"answer": solution})
        raise ValueError(f"no unique puzzle with {self.empty_cells} empty cells in {MAX_REDRAWS} grids")

    @staticmethod
    def puzzle_from_prompt(prompt: str) -> str:
        """The 16-character puzzle of a prompt ``"<puzzle>:"`` or of its chat form (four rows of four of
        ``1234.`` on lines of their own); ValueError if malformed."""
        chat = _CHAT_GRID_RE.search(prompt) if len(prompt) != 17 else None
        if chat is not None:
            return "".join(chat.groups())
        if len(prompt) != 17 or not prompt.endswith(":") or set(prompt[:16]) - set(DIGITS + "."):
            raise ValueError(f"sudoku4 prompt must be 16 characters from '1234.' then ':', got {prompt!r}")
        return prompt[:16]

    def reward(
        self, prompts: list[str], completions: list[str], answer: list[str] | None = None, **fields: Any
    ) -> list[float]:
        """:func:`grid_score` of the grid read (see ``extract``; in the chat format its digits, separators
        dropped); ``answer`` (the solved grid) defaults to solving each prompt."""
        check_aligned(prompts, completions, answer=answer)
        rewards = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            puzzle = self.puzzle_from_prompt(prompt)
            if answer is not None:
                solution = answer[i]
            else:
                found = solve(puzzle, limit=1)
                if not found:
                    raise ValueError(f"sudoku4 prompt {prompt!r} has no solution")
                solution = found[0]
            guess = self.read_answer(completion) or ""
            if self.chat_format:
                guess = "".join(ch for ch in guess if ch.isdigit())
            rewards.append(grid_score(guess, puzzle, solution))
        return rewards
