"""``Task.response_budget``: the response length that holds a task's answers in its format, and
``algorithm.max_new_tokens`` left null settled to it when ais-train validates a run."""

from __future__ import annotations

import random

import pytest

from ais_lightning.app.build import validate
from ais_lightning.app.config import compose_train_config
from ais_lightning.tasks.arithmetic import Arithmetic
from ais_lightning.tasks.countdown import Countdown
from ais_lightning.tasks.sudoku4 import Sudoku4


def longest_solution(task, n=256) -> int:
    rng = random.Random(0)
    return max(len(task.sample(rng).solution) for _ in range(n))


@pytest.mark.parametrize(
    ("task", "longest", "budget"),
    [
        # bare: "138"; chat: "63 + 75 = 138. The answer is \\boxed{138}." (41 characters at most)
        (Arithmetic(format="bare"), 3, 8),  # 4 with the EOS, raised to the floor of 8
        (Arithmetic(format="chat"), 41, 64),
        (Countdown(format="bare"), 26, 32),  # "<answer>(7+7)*2-1</answer>"-like, up to 26
        (Sudoku4(format="bare"), 16, 32),  # 16 digits + EOS = 17 -> 32
        (Sudoku4(format="chat"), 59, 64),
    ],
)
def test_budget_is_the_longest_solution_rounded_up_to_a_power_of_two(task, longest, budget):
    assert longest_solution(task) == longest  # the hand-read maxima the budgets follow from
    assert task.response_budget() == budget
    assert budget >= longest + 1  # room for the answer and the end of sequence


def make(*overrides: str):
    return compose_train_config(["output_dir=/tmp/ais-test-unused", *overrides])


def test_a_null_max_new_tokens_becomes_the_tasks_budget_everywhere_it_is_read(tiny_model_dir):
    cfg = make(
        "policy=local", f"policy.path={tiny_model_dir}", "task=arithmetic"
    )  # chat_template false: bare
    assert cfg.algorithm.max_new_tokens is None
    c = validate(cfg)
    assert c.algorithm.max_new_tokens == 8 and cfg.algorithm.max_new_tokens == 8
    chat = make(
        "policy=local", f"policy.path={tiny_model_dir}", "policy.chat_template=true", "task=arithmetic"
    )
    c = validate(chat)
    assert (c.task.format, c.algorithm.max_new_tokens, chat.algorithm.max_new_tokens) == ("chat", 64, 64)
    assert c.loss.max_response_length == 64  # the groups that interpolate it see the settled value
    warm = validate(make("task=sudoku4"))  # the built-in model: warm start on, as long as the RL validation
    assert warm.algorithm.max_new_tokens == warm.warmstart.max_new_tokens == 32


def test_an_explicit_max_new_tokens_is_kept():
    assert validate(make("algorithm.max_new_tokens=12")).algorithm.max_new_tokens == 12
    with pytest.raises(ValueError, match=r"max_new_tokens"):
        validate(make("algorithm.max_new_tokens=0"))


def test_grpo_module_settles_a_null_budget_from_its_task():
    from ais_lightning.modules.grpo import GRPOModule, GRPOSettings
    from ais_lightning.policy import TinyQwen3

    c = validate(make())
    module = GRPOModule(
        TinyQwen3().build(0),
        Arithmetic(format="chat"),
        c.corrector,
        c.loss,
        c.engine,
        settings=GRPOSettings(max_new_tokens=None),
    )
    assert module.settings.max_new_tokens == 64 and module.sampling.max_new_tokens == 64
