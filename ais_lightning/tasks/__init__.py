"""Tasks for RL of small LLMs: prompt generators, rule-based rewards and a resumable DataModule.

Built-in tasks (the registry :data:`TASKS`): ``arithmetic``, ``countdown``, ``sudoku4``, ``gsm8k``.
``get_task(name, **options)`` builds one; see :mod:`ais_lightning.tasks.base` for adding your own.
Each prompts in a bare format for the built-in character model or in words for a chat model
(``format``, :data:`FORMATS`); :mod:`ais_lightning.tasks.answers` reads answers out of completions.
"""

from typing import Any

from ais_lightning.checks import registered
from ais_lightning.tasks.answers import READERS, extract_answer, normalize_answer
from ais_lightning.tasks.arithmetic import Arithmetic
from ais_lightning.tasks.base import (
    ALLOWED_CHARS,
    FORMATS,
    SOLVED_REWARD,
    Task,
    TaskSample,
    accuracy,
    batch_rewards,
    first_line,
    map_characters,
    safe_rewards,
    to_ascii,
    tokenizer_keeps,
)
from ais_lightning.tasks.countdown import Countdown
from ais_lightning.tasks.datamodule import PromptDataModule, PromptStream, collate_samples, task_fields
from ais_lightning.tasks.gsm8k import GSM8K
from ais_lightning.tasks.sudoku4 import Sudoku4

TASKS: dict[str, type[Task]] = {
    "arithmetic": Arithmetic,
    "countdown": Countdown,
    "sudoku4": Sudoku4,
    "gsm8k": GSM8K,
}
"""The registry of tasks: config name (each class's ``name``) -> class (:func:`get_task`; ``ais-train`` generates
the schema ``schema/task/<name>`` of each; docs/design.md, "Adding a task")."""


def get_task(name: str, **kwargs: Any) -> Task:
    """Build the registered task ``name`` with its options ``kwargs``."""
    return registered(TASKS, name, "task")(**kwargs)


__all__ = [
    "ALLOWED_CHARS",
    "FORMATS",
    "READERS",
    "TASKS",
    "Arithmetic",
    "Countdown",
    "GSM8K",
    "PromptDataModule",
    "PromptStream",
    "Sudoku4",
    "Task",
    "TaskSample",
    "SOLVED_REWARD",
    "accuracy",
    "batch_rewards",
    "collate_samples",
    "extract_answer",
    "first_line",
    "get_task",
    "map_characters",
    "normalize_answer",
    "safe_rewards",
    "task_fields",
    "to_ascii",
    "tokenizer_keeps",
]
