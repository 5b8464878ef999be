import math
import random
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import ClassVar

import pytest

from ais_lightning.tasks import TASKS, Task, TaskSample, get_task, safe_rewards, to_ascii
from ais_lightning.tasks.base import evaluate_expression, expression_numbers, parse_expression, parse_int


def test_builtin_tasks_registered():
    assert {"arithmetic", "countdown", "sudoku4", "gsm8k"} <= set(TASKS)


def test_unknown_task_lists_names():
    with pytest.raises(ValueError, match="arithmetic.*countdown.*gsm8k.*sudoku4"):
        get_task("no_such_task")


def test_a_task_added_to_the_registry_is_built_by_name(monkeypatch):
    @dataclass
    class Reverse(Task):
        name: ClassVar[str] = "test_reverse"
        length: int = 3

        def sample(self, rng: random.Random) -> TaskSample:
            word = "".join(rng.choice("abc") for _ in range(self.length))
            return TaskSample(word + ">", word[::-1], {"answer": word[::-1]})

        def reward(self, prompts, completions, answer=None, **fields):
            return [float(c == a) for c, a in zip(completions, answer)]

    monkeypatch.setitem(TASKS, Reverse.name, Reverse)
    task = get_task("test_reverse", length=4)
    assert isinstance(task, Reverse) and task.length == 4 and task.name == "test_reverse"
    assert "name" not in {
        f.name for f in fields(task)
    }  # a class attribute, not an option (nor a cache-key field)
    s = task.sample(random.Random(1))
    assert len(s.prompt) == 5 and s.solution == s.prompt[:4][::-1]
    assert task(["x"], ["cba"], answer=["cba"]) == [1.0]


def test_every_registered_task_carries_its_registry_name():
    assert all(cls.name == name for name, cls in TASKS.items())


# --------------------------------------------------------------------------------------------- safe_rewards


def test_safe_rewards_passes_fields_and_values():
    def fn(prompts, completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    assert safe_rewards(fn, ["p1", "p2"], ["a", "b"], {"answer": ["a", "x"]}) == ([1.0, 0.0], 0)


def test_safe_rewards_raising_function_scores_all_zero():
    def fn(prompts, completions):
        raise RuntimeError("boom")

    assert safe_rewards(fn, ["p"] * 3, ["c"] * 3) == ([0.0, 0.0, 0.0], 3)


def test_safe_rewards_non_finite_and_non_numeric_entries():
    def fn(prompts, completions):
        return [1.0, math.nan, math.inf, None, "abc", 0.5]

    assert safe_rewards(fn, ["p"] * 6, ["c"] * 6) == ([1.0, 0.0, 0.0, 0.0, 0.0, 0.5], 4)


@pytest.mark.parametrize("returned", [[1.0], [1.0, 1.0, 1.0], 3.0, None])
def test_safe_rewards_wrong_length_or_not_a_sequence(returned):
    assert safe_rewards(lambda p, c: returned, ["p", "q"], ["c", "d"]) == ([0.0, 0.0], 2)


def test_safe_rewards_rejects_misaligned_inputs():
    with pytest.raises(ValueError, match="completions"):
        safe_rewards(lambda p, c: [0.0], ["p"], ["c", "d"])
    with pytest.raises(ValueError, match="answer"):
        safe_rewards(lambda p, c, answer: [0.0], ["p"], ["c"], {"answer": [1, 2]})


# ----------------------------------------------------------------------------------------- text helpers


def test_to_ascii():
    assert (
        to_ascii("Caf\u00e9 \u2018x\u2019 \u201cy\u201d 3\u20134 \u00bd\tz\r\n\u4e2d")
        == "Cafe 'x' \"y\" 3-4 1/2 z\n"
    )


def test_parse_int():
    assert parse_int(" 46 ") == 46 and parse_int("-3") == -3 and parse_int("+7") == 7
    assert parse_int("4 6") is None and parse_int("46.0") is None and parse_int("") is None
    assert parse_int("\u0664\u0666") is None  # Arabic-Indic digits are not ASCII


# ------------------------------------------------------------------------------------ safe expressions


def test_expression_evaluates_exactly():
    tree = parse_expression("(3+5)*2 - 7/2")
    assert evaluate_expression(tree) == Fraction(25, 2)
    assert expression_numbers(tree) == [3, 5, 2, 7, 2]


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os')",
        "2**10",
        "-3+4",
        "1.5+2",
        "abs(3)",
        "3 4",
        "",
        "1+" * 150 + "1",
        "(1,2)",
        "3//2",
        "7%2",
    ],
)
def test_expression_rejects_anything_but_integer_arithmetic(text):
    with pytest.raises(ValueError):
        parse_expression(text)


def test_division_by_zero_raises_zero_division():
    with pytest.raises(ZeroDivisionError):
        evaluate_expression(parse_expression("3/(2-2)"))
