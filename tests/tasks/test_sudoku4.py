import random

import pytest

from ais_lightning.tasks import get_task
from ais_lightning.tasks.sudoku4 import is_valid_grid, solve

SOLUTION = "1234341221434321"  # rows 1234 / 3412 / 2143 / 4321: checked by hand
PUZZLE = "12..34..2.4343.1"  # empty cells at 2, 3, 6, 7, 9, 14 (6 cells)


def independent_check(grid: str) -> bool:
    rows = [grid[4 * r : 4 * r + 4] for r in range(4)]
    cols = ["".join(row[c] for row in rows) for c in range(4)]
    boxes = [rows[r][c : c + 2] + rows[r + 1][c : c + 2] for r in (0, 2) for c in (0, 2)]
    return all(sorted(unit) == list("1234") for unit in rows + cols + boxes)


def test_hand_made_grid_is_valid():
    assert independent_check(SOLUTION) and is_valid_grid(SOLUTION)
    assert not is_valid_grid("1234123412341234") and not independent_check("1234123412341234")
    assert all(p == "." or p == s for p, s in zip(PUZZLE, SOLUTION))


def test_reward_exact_values():
    task = get_task("sudoku4")
    wrong_two = SOLUTION[:2] + "43" + SOLUTION[4:]  # cells 2 and 3 swapped: 4 of 6 empty cells right
    completions = [
        SOLUTION,
        SOLUTION + "\nmore text",
        wrong_two,
        "1231341221434321",  # cell 3 wrong only: 5 of 6
        SOLUTION[:15],  # too short: malformed
        SOLUTION[:15] + "5",  # digit out of range: malformed
        "12..341221434321",  # dots: malformed
        "",
    ]
    n = len(completions)
    got = task.reward([PUZZLE + ":"] * n, completions, answer=[SOLUTION] * n)
    assert got == [1.0, 1.0, 4 / 6, 5 / 6, 0.0, 0.0, 0.0, 0.0]


def test_reward_without_fields_solves_the_prompt():
    task = get_task("sudoku4")
    assert task.reward([PUZZLE + ":"], [SOLUTION]) == [1.0]
    with pytest.raises(ValueError, match="sudoku4 prompt"):
        task.reward(["12..:"], [SOLUTION])


def test_other_valid_solution_of_a_non_unique_puzzle_scores_one():
    puzzle = "........21434321"  # rows 3-4 of SOLUTION given, rows 1-2 empty (8 cells)
    other = "3412123421434321"  # rows 1 and 2 of SOLUTION swapped: also valid, keeps the clues
    solutions = solve(puzzle, limit=10)
    assert independent_check(other) and SOLUTION in solutions and other in solutions
    task = get_task("sudoku4")
    # matching the reference cell by cell would give 0/8; a valid grid that keeps the clues is a solution
    assert task.reward([puzzle + ":"], [other], answer=[SOLUTION]) == [1.0]
    invalid = "2134341221434321"  # cells 0 and 1 swapped: column 1 repeats 2, 6 of 8 empty cells right
    assert not independent_check(invalid)
    assert task.reward([puzzle + ":"], [invalid], answer=[SOLUTION]) == [6 / 8]


@pytest.mark.parametrize("empty_cells", [4, 8, 11])
def test_generated_puzzles_are_valid_and_unique(empty_cells):
    task = get_task("sudoku4", empty_cells=empty_cells)
    rng = random.Random(empty_cells)
    for _ in range(25):
        s = task.sample(rng)
        puzzle = s.prompt[:-1]
        assert len(s.prompt) == 17 and s.prompt.endswith(":") and puzzle.count(".") == empty_cells
        assert independent_check(s.solution) and s.fields == {"answer": s.solution}
        assert all(p == "." or p == g for p, g in zip(puzzle, s.solution))
        assert solve(puzzle, limit=5) == [s.solution]


def test_non_unique_mode_gives_valid_puzzles():
    task = get_task("sudoku4", empty_cells=14, unique=False)
    s = task.sample(random.Random(3))
    assert (
        s.prompt.count(".") == 14
        and independent_check(s.solution)
        and s.solution in solve(s.prompt[:-1], 500)
    )


@pytest.mark.parametrize(
    "kwargs", [{"empty_cells": 0}, {"empty_cells": 13}, {"empty_cells": 17, "unique": False}]
)
def test_bad_options(kwargs):
    with pytest.raises(ValueError):
        get_task("sudoku4", **kwargs)
