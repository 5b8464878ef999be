"""``task.format=auto`` follows ``policy.chat_template`` when ais-train builds a run, and a run whose reward
never fires says so: a WARNING during training and lines in the end-of-run summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ais_lightning.app.build import validate
from ais_lightning.app.config import compose_train_config
from tests.integration.helpers import SMOKE, run_train


def make(*overrides: str):
    return compose_train_config(["output_dir=/tmp/ais-test-unused", *overrides])


def chat_policy(directory: Path) -> list[str]:
    # validate() builds no model: the local policy's directory is only checked to hold a model
    return ["policy=local", f"policy.path={directory}", "policy.chat_template=true"]


@pytest.mark.parametrize("task", ["arithmetic", "countdown", "sudoku4"])
def test_auto_follows_the_policys_chat_template(task, tiny_model_dir):
    cfg = make(f"task={task}", *chat_policy(tiny_model_dir))
    assert cfg.task.format == "auto" and cfg.task.extract is None
    c = validate(cfg)
    assert c.task.format == "chat" and cfg.task.format == "chat"  # the logged config names it too
    assert c.task.sample(__import__("random").Random(0)).prompt.endswith("in \\boxed{}.")
    plain = make(f"task={task}")
    assert validate(plain).task.format == "bare" and plain.task.format == "bare"  # the tiny model: bare


def test_an_explicit_format_is_kept(tiny_model_dir):
    assert validate(make("task.format=bare", *chat_policy(tiny_model_dir))).task.format == "bare"
    chat = validate(make("task.format=chat", "task.extract=[boxed]"))  # the tiny model on chat prompts
    assert (chat.task.format, chat.task.readers) == ("chat", ("boxed",))


def test_bad_format_options_name_the_key():
    with pytest.raises(
        ValueError, match=r"task\.format must be one of \['auto', 'bare', 'chat'\], got 'Chat'"
    ):
        validate(make("task.format=Chat"))
    with pytest.raises(ValueError, match=r"task\.extract has unknown reader\(s\) \['box'\]"):
        validate(make("task.extract=[box]"))
    with pytest.raises(ValueError, match=r"algorithm\.constant_reward_steps must be an int >= 0, got -1"):
        validate(make("algorithm.constant_reward_steps=-1"))


@pytest.mark.slow
def test_a_run_whose_reward_never_fires_warns_and_says_so_in_the_summary(tmp_path: Path):
    out = tmp_path / "run"
    # 4 new tokens can never write a 16-digit grid: every reward is exactly 0
    args = [
        *SMOKE,
        "task=sudoku4",
        "algorithm.constant_reward_steps=2",
        "logger=none",
        f"hydra.run.dir={out}",
    ]
    proc = run_train(args, cwd=tmp_path)
    logs = proc.stdout + proc.stderr
    assert logs.count("on every sample of 2 consecutive rollout steps") == 1
    assert "[WARNING] - task 'sudoku4': the reward was 0 (the reward never fired)" in logs
    assert (
        "WARNING               task 'sudoku4': the training reward never fired "
        "(0 on every sample of all 2 steps);" in proc.stdout
    )
    assert (
        "WARNING               task 'sudoku4': validation accuracy was 0 at all 2 validation(s)"
        in proc.stdout
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "sudoku4" and summary["reward_constant"] == 0.0
    never = summary["validation_never_correct"]
    assert never["validations"] == 2 and never["metrics"] == ["val/accuracy_engine", "val/accuracy_trainer"]
    assert never["example"]["solution"] and never["example"]["prompt"].endswith(":")
    history = json.loads((out / "history.json").read_text())
    assert [(h["reward_min"], h["reward_max"]) for h in history] == [(0.0, 0.0), (0.0, 0.0)]
