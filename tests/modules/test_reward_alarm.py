"""The constant-reward alarm of GRPOModule, on the tiny model with real Lightning Trainers: one WARNING after
``constant_reward_steps`` steps whose samples all got one reward, the history and validation records the
summary reads, and the summary's lines."""

from __future__ import annotations

import logging

import lightning as L
import pytest
from torch.utils.data import DataLoader

from ais_lightning.app.summary import format_summary, summarize
from ais_lightning.correctors import AIS
from ais_lightning.losses import GRPOLoss
from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.modules.grpo import GRPOModule, GRPOSettings
from ais_lightning.policy import Policy
from ais_lightning.rollout import TorchRolloutEngine
from ais_lightning.tasks import get_task
from ais_lightning.tasks.arithmetic import Arithmetic

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BATCH = {"prompt": ["1+2=", "3+4="], "solution": ["3", "7"], "answer": [3, 7]}
SUDOKU = {"prompt": [".2...34.24133.24:"], "solution": ["4231134224133124"], "answer": ["4231134224133124"]}


class Constant(Arithmetic):
    """A reward that never changes."""

    def reward(self, prompts, completions, **fields):
        return [0.5] * len(completions)


class OddCharacters(Arithmetic):
    """A reward an untrained model already varies on."""

    def reward(self, prompts, completions, **fields):
        return [sum(ord(c) % 2 for c in text) / max(len(text), 1) for text in completions]


def module(task, **settings) -> GRPOModule:
    return GRPOModule(
        policy=Policy(build_tiny_qwen3(seed=0), build_char_tokenizer()),
        task=task,
        corrector=AIS(),
        loss=GRPOLoss(),
        engine_factory=lambda m: TorchRolloutEngine(m, precision="fp32"),
        settings=GRPOSettings(group_size=2, max_new_tokens=4, lr=1e-3, **settings),
        eval_engine_factory=lambda m: TorchRolloutEngine(m, precision="fp32"),
    )


def trainer(steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fit(m: GRPOModule, steps: int, batch: dict | None = None) -> None:
    loader = DataLoader([batch or BATCH] * steps, batch_size=None, collate_fn=lambda b: b)
    trainer(steps).fit(m, train_dataloaders=loader)


def alarms(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ais_lightning.modules.grpo"]


def test_a_reward_that_never_fires_warns_once_with_a_sample(caplog):
    m = module(get_task("sudoku4"), constant_reward_steps=2)  # 4 tokens can never fill a 16-cell grid
    with caplog.at_level(logging.WARNING, logger="ais_lightning.modules.grpo"):
        fit(m, 3, SUDOKU)
    (message,) = alarms(caplog)  # once, though all 3 steps scored 0
    assert message.startswith(
        "task 'sudoku4': the reward was 0 (the reward never fired) on every sample of 2 consecutive rollout "
        "steps (steps 1-2). GRPO's advantages are zero"
    )
    assert "A sample: prompt '.2...34.24133.24:' -> completion " in message
    assert "; reference solution '4231134224133124'. If the policy cannot answer" in message
    assert "If the policy cannot answer in the task's format, check task.format" in message
    assert "(algorithm.constant_reward_steps sets this check; 0 turns it off)." in message
    assert m.reward_alarm == {"streak": 3, "value": 0.0, "first_step": 1, "warned": True}
    assert [(h["reward_min"], h["reward_max"]) for h in m.history] == [(0.0, 0.0)] * 3
    summary = summarize(m.history, task="sudoku4")
    assert summary["reward_constant"] == 0.0
    assert (
        "WARNING               task 'sudoku4': the training reward never fired (0 on every sample of all 3 "
        "steps);\n                      GRPO's advantages were all zero, so the run learned nothing"
    ) in format_summary(summary)


def test_a_constant_nonzero_reward_is_named_and_zero_steps_turn_the_warning_off(caplog):
    m = module(Constant(), constant_reward_steps=2)
    m.validation_history = [{"step": 0, "accuracy": {"val/accuracy_engine": 0.25}, "example": {}}]
    with caplog.at_level(logging.WARNING, logger="ais_lightning.modules.grpo"):
        fit(m, 2)
    (message,) = alarms(caplog)
    assert message.startswith("task 'arithmetic': the reward was 0.5 on every sample of 2 consecutive")
    # greedy answers scored at the validation: the advice is to sample more, not to change the format
    assert "Greedy validation answers did score, so the policy can answer in the task's format" in message
    text = format_summary(summarize(m.history, validations=m.validation_history))
    assert (
        "the training reward was constant (0.5 on every sample of all 2 steps);\n"
        "                      GRPO's advantages were all zero, so the run learned nothing\n"
        "                      greedy validation answers did score: sample more per step"
    ) in text
    assert "check task.format" in format_summary(summarize(m.history))  # no validation: both advices
    caplog.clear()
    off = module(Constant(), constant_reward_steps=0)
    with caplog.at_level(logging.WARNING, logger="ais_lightning.modules.grpo"):
        fit(off, 2)
    assert alarms(caplog) == [] and off.reward_alarm["streak"] == 2 and not off.reward_alarm["warned"]
    assert summarize(off.history)["reward_constant"] == 0.5  # the summary still says so


def test_a_varying_reward_never_warns(caplog):
    m = module(OddCharacters(digits=1), constant_reward_steps=1)
    with caplog.at_level(logging.WARNING, logger="ais_lightning.modules.grpo"):
        fit(m, 2)
    assert alarms(caplog) == [] and m.reward_alarm["streak"] == 0
    assert all(h["reward_max"] > h["reward_min"] for h in m.history)
    summary = summarize(m.history)
    assert summary["reward_constant"] is None and "WARNING" not in format_summary(summary)


def test_validation_records_accuracy_and_an_example_for_the_summary():
    m = module(get_task("arithmetic"))
    val = DataLoader([BATCH], batch_size=None, collate_fn=lambda b: b)
    trainer(1).validate(m, dataloaders=val, verbose=False)
    (record,) = m.validation_history
    assert record["step"] == 0
    assert record["accuracy"] == {"val/accuracy_engine": 0.0, "val/accuracy_trainer": 0.0}  # untrained
    assert record["example"]["prompt"] == "1+2=" and record["example"]["solution"] == "3"
    completion = record["example"]["completion"]
    summary = summarize([], validations=m.validation_history, task="arithmetic")
    assert summary["validation_never_correct"] == {
        "validations": 1,
        "metrics": ["val/accuracy_engine", "val/accuracy_trainer"],
        "example": {"prompt": "1+2=", "completion": completion, "solution": "3"},
    }
    text = format_summary(summary)
    assert (
        "WARNING               task 'arithmetic': validation accuracy was 0 at all 1 validation(s) "
        "(engine, trainer):\n                      no greedy answer was read as right\n"
        "                      e.g. prompt '1+2='\n"
        f"                        -> {completion!r}\n"
        "                        reference '3'\n"
        "                      check task.format and task.extract"
    ) in text
    state = {}
    m.on_save_checkpoint(state)
    restored = module(get_task("arithmetic"))
    restored.on_load_checkpoint(state)
    assert restored.validation_history == m.validation_history and restored.reward_alarm == m.reward_alarm


def test_summary_of_accuracies_that_were_right_once():
    validations = [
        {"step": 0, "accuracy": {"val/accuracy_engine": 0.0, "val/accuracy_trainer": 0.0}},
        {"step": 5, "accuracy": {"val/accuracy_engine": 0.25, "val/accuracy_trainer": 0.0}},
    ]
    assert summarize([], validations=validations)["validation_never_correct"] == {
        "validations": 2,
        "metrics": ["val/accuracy_trainer"],
        "example": {},
    }
    validations[1]["accuracy"]["val/accuracy_trainer"] = 0.5
    assert summarize([], validations=validations)["validation_never_correct"] is None
    old = [{"step": 1.0, "reward": 0.0}]  # a history from before reward_min/max were recorded
    assert summarize(old)["reward_constant"] is None


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_constant_reward_steps_is_checked(bad):
    with pytest.raises(ValueError, match="constant_reward_steps must be an int >= 0"):
        GRPOSettings(constant_reward_steps=bad)
