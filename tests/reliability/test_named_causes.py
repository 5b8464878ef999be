"""Each minor failure names its cause (issue 45, cases 11 and 12), most before anything heavy starts.

Before: ``policy=local`` without tokenizer files failed at the first validation (``prompts[0] must be a
non-empty list of token ids``) and on a directory that is no model asked to install sentencepiece; a seed past
numpy's range raised numpy's bound error naming no key; ``algorithm.lr=1e30`` was accepted (the run collapsed
and exited 0); a reward of 1e308 surfaced as "non-finite values"; ``sys.exit(0)`` inside a reward ended the run
reported as a SIGTERM; a read-only home failed in a bare ``mkdir``; a locked or corrupt ``mlflow.db`` was found
after the model was built; a truncated safetensors file raised safetensors' header error and a tokenizer larger
than the model's embedding indexed outside it.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
from pathlib import Path

import pytest

from ais_lightning.app.tracking import LoggerSettings, check_tracking_uri
from ais_lightning.tasks import safe_rewards
from tests.reliability.runs import SMOKE, mlflow_runs
from tests.reliability.test_bad_configs import make, validate


# ----------------------------------------------------------------- case 11: a local model directory, checked
@pytest.mark.parametrize(
    "keep, missing",
    [
        (("config.json", "model.safetensors"), "no tokenizer (tokenizer.json"),
        ((), "no config.json and no weights"),
    ],
)
def test_a_local_policy_directory_is_checked_at_config_time_naming_what_is_missing(
    tiny_model_dir, tmp_path: Path, keep, missing
):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "README.md").write_text("not a model\n")
    for name in keep:
        shutil.copy(Path(tiny_model_dir) / name, directory / name)
    with pytest.raises(ValueError) as err:
        validate(make("policy=local", f"policy.path={directory}"))
    message = str(err.value)
    assert message.startswith(f"policy.path={directory} is not a complete Hugging Face model directory"), (
        message
    )
    assert missing in message and "README.md" in message


def test_damaged_weights_and_a_tokenizer_larger_than_the_model_are_named(tiny_model_dir, tmp_path: Path):
    import json

    from ais_lightning.policy.builders import Pretrained

    truncated = Path(shutil.copytree(tiny_model_dir, tmp_path / "truncated"))
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"truncated: the weights could not be read \(SafetensorError"):
        Pretrained(path=str(truncated)).build()
    larger = Path(shutil.copytree(tiny_model_dir, tmp_path / "larger"))
    spec = json.loads((larger / "tokenizer.json").read_text())
    spec["model"]["vocab"].update({f"extra{i}": 99 + i for i in range(20)})  # 119 tokens, 99 embedding rows
    (larger / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(
        ValueError, match=r"its tokenizer has 119 tokens but the model's embedding only 99 rows"
    ):
        Pretrained(path=str(larger)).build()


# ------------------------------------------------------------------------------- case 12: bad numbers
@pytest.mark.parametrize(
    "override, message",
    [
        ("seed=4294967296", r"seed must be an int from 0 to 4294967295 .* got 4294967296"),
        ("seed=-1", r"seed must be an int from 0 to 4294967295"),
        ("warmstart.seed=-1", r"warmstart\.seed must be an int from 0 to 4294967295"),
        ("algorithm.lr=1e30", r"algorithm\.lr must be a number in \(0, 1\]"),
    ],
)
def test_a_seed_numpy_refuses_and_an_absurd_lr_fail_validation_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        validate(make(override))


def test_a_reward_too_large_for_float32_statistics_is_scored_0_and_named(caplog):
    with caplog.at_level(logging.WARNING, logger="ais_lightning.tasks.base"):
        rewards, failed = safe_rewards(lambda p, c: [1e308, -1e308, 1.0], ["a", "b", "c"], ["x", "y", "z"])
    assert (rewards, failed) == ([0.0, 0.0, 1.0], 2)
    assert "2 values beyond +-1e+18 (e.g. 1e+308)" in caplog.text and "overflow" in caplog.text, caplog.text


def test_sys_exit_inside_a_reward_is_a_failure_of_the_reward(caplog):
    def exits(prompts, completions):
        raise SystemExit(0)

    with caplog.at_level(logging.WARNING, logger="ais_lightning.tasks.base"):
        assert safe_rewards(exits, ["a", "b"], ["x", "y"]) == ([0.0, 0.0], 2)
    assert "SystemExit(0) (sys.exit called in the reward)" in caplog.text, caplog.text


@pytest.mark.slow
def test_sys_exit_during_training_is_an_error_not_a_sigterm(in_process, tmp_path: Path):
    """Lightning marks the trainer INTERRUPTED on any exception, and every such ``SystemExit`` was taken for
    Lightning's own Ctrl+C or a SIGTERM: the run ended "interrupted", exit 143."""
    out = tmp_path / "run"
    engine = "rollout._target_=tests.reliability.faults.ExitOnSampleEngine"
    with pytest.raises(RuntimeError, match=r"SystemExit\(0\) raised during training"):
        in_process([*SMOKE, engine, "logger=mlflow", f"output_dir={out}"])
    (record,) = mlflow_runs(out / "mlflow.db")
    assert record.info.status == "FAILED"


def test_a_read_only_home_names_the_warm_start_cache_and_the_way_out(tmp_path: Path, monkeypatch):
    blocker = tmp_path / "a_file"  # a cache under a regular file: unwritable even for root
    blocker.write_text("")
    monkeypatch.setenv("AIS_LIGHTNING_CACHE", str(blocker / "cache"))
    c = validate(make("warmstart=default", "warmstart.enabled=true", "warmstart.steps=1"))
    with pytest.raises(ValueError) as err:
        c.initial_policy(seed=0)
    message = str(err.value)
    assert "warmstart.cache_dir" in message and "is not writable" in message, message
    assert "$AIS_LIGHTNING_CACHE" in message


# ---------------------------------------------------------------------------- a store found bad up front
def test_a_corrupt_store_is_refused_before_anything_is_built(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "mlflow.db").write_bytes(b"these bytes are not an SQLite database\n" * 50)
    with pytest.raises(
        ValueError, match=r"mlflow\.db is not a readable SQLite database \(file is not a database"
    ):
        check_tracking_uri(LoggerSettings(), str(tmp_path))


@pytest.mark.slow  # waits 5 s for the lock
def test_a_store_locked_by_another_program_is_refused_naming_it(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    holder = sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")  # as an sqlite3 shell in a transaction would
    try:
        with pytest.raises(ValueError, match=r"mlflow\.db is locked by another program for over 5 s"):
            check_tracking_uri(LoggerSettings(), str(tmp_path))
    finally:
        holder.rollback()
        holder.close()
    check_tracking_uri(LoggerSettings(), str(tmp_path))  # free again: accepted
