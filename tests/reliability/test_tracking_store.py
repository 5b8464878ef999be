"""The MLflow store named by ``logger.tracking_uri`` is opened before anything heavy (unit level)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ais_lightning.app.tracking import LoggerSettings, check_tracking_uri

mlflow_env = pytest.importorskip("mlflow.environment_variables")


@pytest.mark.skipif(
    not hasattr(mlflow_env, "MLFLOW_ALLOW_FILE_STORE"),
    reason="this MLflow accepts file stores unconditionally",
)
def test_a_refused_file_store_is_named_with_the_key_and_the_way_out(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    uri = f"file://{tmp_path / 'mlruns'}"
    with pytest.raises(ValueError) as err:
        check_tracking_uri(LoggerSettings(tracking_uri=uri), str(tmp_path))
    message = str(err.value)
    assert message.startswith(f"logger.tracking_uri={uri} is a file store"), message
    assert "sqlite:///" in message and "MLFLOW_ALLOW_FILE_STORE=true" in message


def test_an_allowed_file_store_and_a_plain_path_pass(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_tracking_uri(LoggerSettings(tracking_uri=f"file://{tmp_path / 'a'}"), str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    check_tracking_uri(LoggerSettings(tracking_uri=str(tmp_path / "b")), str(tmp_path))


@pytest.mark.skipif(
    not hasattr(mlflow_env, "MLFLOW_ALLOW_FILE_STORE"),
    reason="this MLflow accepts file stores unconditionally",
)
def test_a_relative_path_is_a_file_store_and_other_schemes_are_not_opened(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="logger.tracking_uri=mlruns is a file store"):
        check_tracking_uri(LoggerSettings(tracking_uri="mlruns"), str(tmp_path))
    check_tracking_uri(LoggerSettings(tracking_uri="databricks"), str(tmp_path))  # not a path: left to MLflow


def test_other_loggers_open_no_store(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    check_tracking_uri(LoggerSettings(name="csv", tracking_uri=f"file://{tmp_path}"), str(tmp_path))


@pytest.mark.slow  # two fresh SQLite stores run MLflow's schema migrations
def test_a_run_leaves_no_tracking_uri_behind_so_a_later_resume_continues_its_own_store(
    tmp_path: Path, monkeypatch
):
    """Lightning's MLFlowLogger exports ``$MLFLOW_TRACKING_URI`` (``mlflow.set_tracking_uri``) when it starts a
    run: a second run in the same process took the first one's store for an explicit choice, and its resume
    started a new run there instead of continuing its checkpoint's run."""
    import os

    from ais_lightning.app.tracking import build_logger, logger_target

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    settings = LoggerSettings(name="mlflow")
    first = build_logger(settings, str(tmp_path / "a"))
    assert first.run_id and "MLFLOW_TRACKING_URI" not in os.environ
    second = build_logger(settings, str(tmp_path / "b"))
    resume = {"run_id": second.run_id, "tracking_uri": second._tracking_uri}
    assert logger_target(settings, str(tmp_path / "b"), resume) == (second._tracking_uri, second.run_id)
    monkeypatch.setenv(
        "MLFLOW_TRACKING_URI", "sqlite:///" + str(tmp_path / "mine.db")
    )  # the user's own choice
    build_logger(settings, str(tmp_path / "c"))
    assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:///" + str(tmp_path / "mine.db")
