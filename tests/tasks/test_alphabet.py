import random
from pathlib import Path

import pytest

from ais_lightning.models import build_char_tokenizer
from ais_lightning.tasks import get_task
from ais_lightning.tasks.base import tokenizer_keeps

PRINTABLE = {chr(c) for c in range(32, 127)} | {"\n"}  # the built-in character-level tokenizer's alphabet
SAMPLE = Path(__file__).with_name("gsm8k_sample.jsonl")


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("arithmetic", {}),
        ("arithmetic", {"digits": 4, "min_digits": 1, "operators": "+-*", "num_operands": 3}),
        ("countdown", {}),
        ("countdown", {"num_numbers": 4, "max_number": 50}),
        ("sudoku4", {}),
        ("sudoku4", {"empty_cells": 16, "unique": False}),
        ("gsm8k", {"path": str(SAMPLE), "use_datasets": False}),
    ],
)
def test_prompts_and_solutions_use_the_tokenizer_alphabet(name, kwargs):
    """Once fitted to the built-in tokenizer (as ``ais-train`` fits a task to its policy's): the generated tasks
    write in its alphabet anyway; the GSM8K sample's accented names are mapped."""
    task = get_task(name, **kwargs)
    task.fit_text(tokenizer_keeps(build_char_tokenizer()))
    rng = random.Random(0)
    for _ in range(50):
        s = task.sample(rng)
        assert s.prompt and s.solution
        assert set(s.prompt) <= PRINTABLE, s.prompt
        assert set(s.solution) <= PRINTABLE, s.solution
