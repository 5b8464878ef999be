import random

import pytest

from ais_lightning.tasks import get_task
from ais_lightning.tasks.base import expression_numbers, parse_expression
from ais_lightning.tasks.countdown import parse_countdown_prompt, reachable_values


def test_reward_branches_exact_values():
    task = get_task("countdown")
    completions = [
        "<answer>(3+5)*2</answer>",  # correct
        "think... <answer>2*(5+3)</answer>",  # correct, other order
        "<answer>5*3+2-1</answer>",  # 17: wrong value, well formed
        "<answer>(3+3)*2</answer>",  # reuses 3
        "<answer>(3+5)*2*9</answer>",  # uses a number that is not given
        "<answer>3/(5-5)</answer>",  # reuses 5 and divides by zero
        "<answer>16</answer>",  # 16 is not one of the numbers
        "(3+5)*2",  # no tags
        "<answer>(3+5)*</answer>",  # does not parse
        "<answer>__import__('os')</answer>",  # not arithmetic
        "<answer>-3+19</answer>",  # unary minus is not allowed
    ]
    n = len(completions)
    got = task.reward(["3 5 2>16:"] * n, completions, numbers=[[3, 5, 2]] * n, target=[16] * n)
    assert got == [1.0, 1.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0]


def test_reward_uses_last_answer_and_parses_prompt_without_fields():
    task = get_task("countdown")
    wrong_then_right = "<answer>3+5</answer> no, <answer>(3+5)*2</answer>"
    right_then_wrong = "<answer>(3+5)*2</answer> no, <answer>3+5</answer>"
    assert task.reward(["3 5 2>16:", "3 5 2>16:"], [wrong_then_right, right_then_wrong]) == [1.0, 0.1]
    # fractions are fine in the equation: 7/2*2 = 7 (each number once: 7, 2, 2 given)
    assert task.reward(["7 2 2>7:"], ["<answer>7/2*2</answer>"]) == [1.0]


def test_parse_prompt():
    assert parse_countdown_prompt("12 5 2>34:") == ([12, 5, 2], 34)
    with pytest.raises(ValueError, match="countdown prompt"):
        parse_countdown_prompt("12,5,2>34")


def test_reachable_values_small_case():
    table = reachable_values([2, 3])
    # hand-enumerated: 2+3, 3-2, 2*3 (2/3 and 2-3 are not non-negative integers)
    assert set(table[0b11]) == {5, 1, 6}
    assert table[0b01] == {2: "2"} and table[0b10] == {3: "3"}


@pytest.mark.parametrize(
    "kwargs", [{}, {"num_numbers": 4, "max_number": 25}, {"num_numbers": 4, "use_all": True}]
)
def test_samples_are_solved_by_their_solution(kwargs):
    task = get_task("countdown", **kwargs)
    rng = random.Random(0)
    for _ in range(30):
        s = task.sample(rng)
        numbers, target = parse_countdown_prompt(s.prompt)
        assert s.fields == {"numbers": numbers, "target": target}
        assert 1 <= target <= task.max_target and target not in numbers
        assert len(numbers) == task.num_numbers and all(1 <= x <= task.max_number for x in numbers)
        assert task.reward([s.prompt], [s.solution]) == [1.0]
        if task.use_all:
            inner = s.solution[len("<answer>") : -len("</answer>")]
            assert sorted(expression_numbers(parse_expression(inner))) == sorted(numbers)


@pytest.mark.parametrize(
    "kwargs", [{"num_numbers": 1}, {"num_numbers": 6}, {"max_target": 0}, {"format_score": 1.0}]
)
def test_bad_options(kwargs):
    with pytest.raises(ValueError):
        get_task("countdown", **kwargs)
