"""Tasks for RL of small LLMs: prompt generators, rule-based rewards and a resumable DataModule.

Built-in tasks (registered on import): ``arithmetic``, ``countdown``, ``sudoku4``, ``gsm8k``.
``get_task(name, **options)`` builds one; see :mod:`ais_lightning.tasks.base` for adding your own.
Each prompts in a bare format for the built-in character model or in words for a chat model
(``format``, :data:`FORMATS`); :mod:`ais_lightning.tasks.answers` reads answers out of completions.
"""

from ais_lightning.tasks.answers import READERS, extract_answer, normalize_answer
from ais_lightning.tasks.arithmetic import Arithmetic
from ais_lightning.tasks.base import (
    ALLOWED_CHARS,
    FORMATS,
    SOLVED_REWARD,
    TASKS,
    Task,
    TaskSample,
    accuracy,
    batch_rewards,
    first_line,
    get_task,
    map_characters,
    register_task,
    safe_rewards,
    to_ascii,
    tokenizer_keeps,
)
from ais_lightning.tasks.countdown import Countdown
from ais_lightning.tasks.datamodule import PromptDataModule, PromptStream, collate_samples, task_fields
from ais_lightning.tasks.gsm8k import GSM8K
from ais_lightning.tasks.sudoku4 import Sudoku4

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
    "register_task",
    "safe_rewards",
    "task_fields",
    "to_ascii",
    "tokenizer_keeps",
]
