"""Loading: an MLflow store (SQLite, file store or tracking server) -> :class:`RunRecord` s.

MLflow is imported only when a store is opened.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ais_lightning.toolkit.report.records import MetricNames, ReportError, RunRecord


def _client(tracking_uri: str) -> Any:
    """An MlflowClient. An existing file store (``file:///...`` or a bare path: where older sweeps
    live) is opened although MLflow >= 3 refuses file stores unless ``MLFLOW_ALLOW_FILE_STORE``."""
    from mlflow import MlflowClient

    if "://" in tracking_uri and not tracking_uri.startswith("file:"):
        return MlflowClient(tracking_uri=tracking_uri)
    previous = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        return MlflowClient(tracking_uri=tracking_uri)  # the store is built (and cached) here
    finally:
        if previous is None:
            del os.environ["MLFLOW_ALLOW_FILE_STORE"]
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = previous


def check_store_exists(tracking_uri: str) -> None:
    """ReportError when a local store (``sqlite:///path``, ``file:///path`` or a bare path) is
    missing: opening it would silently create an empty one (and, for SQLite, run migrations)."""
    if tracking_uri.startswith("sqlite:///"):
        path = Path(unquote(tracking_uri.removeprefix("sqlite:///")))
    elif tracking_uri.startswith("file:"):
        path = Path(unquote(urlparse(tracking_uri).path))
    elif "://" not in tracking_uri:
        path = Path(tracking_uri)
    else:
        return
    if not path.exists():
        raise ReportError(f"no MLflow store at {path} (tracking URI {tracking_uri})")


def _find_experiment(client: Any, experiment: str, tracking_uri: str) -> Any:
    exp = client.get_experiment_by_name(experiment)
    if exp is None and experiment.isdigit():
        from mlflow.exceptions import MlflowException

        try:
            exp = client.get_experiment(experiment)
        except MlflowException:  # no experiment with that id
            exp = None
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ReportError(
            f"experiment {experiment!r} does not exist at {tracking_uri} (experiments there: {names})"
        )
    return exp


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        # several values at one step: keep the one logged last
        if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
            by_step[m.step] = (m.timestamp, float(m.value))
    return [(step, by_step[step][1]) for step in sorted(by_step)]


def load_runs(
    tracking_uri: str,
    experiment: str,
    metric_names: MetricNames | None = None,
    extra_keys: tuple[str, ...] | list[str] = (),
) -> list[RunRecord]:
    """All active runs of ``experiment`` (by name, or by id) at ``tracking_uri``, any status.

    Histories are fetched with ``MlflowClient.get_metric_history`` for every metric in
    ``metric_names`` and ``extra_keys`` that the run logged. Raises ReportError when the store or
    the experiment does not exist.
    """
    names = metric_names or MetricNames()
    check_store_exists(tracking_uri)
    client = _client(tracking_uri)
    exp = _find_experiment(client, experiment, tracking_uri)
    wanted = {getattr(names, f.name) for f in dataclasses.fields(names)} | set(extra_keys)
    records: list[RunRecord] = []
    token = None
    while True:
        page = client.search_runs([exp.experiment_id], max_results=1000, page_token=token)
        for run in page:
            metrics = dict(run.data.metrics)
            records.append(
                RunRecord(
                    run_id=run.info.run_id,
                    run_name=run.info.run_name or "",
                    status=run.info.status,
                    params=dict(run.data.params),
                    metrics=metrics,
                    histories={
                        k: _history(client, run.info.run_id, k) for k in sorted(wanted & set(metrics))
                    },
                    start_time_ms=run.info.start_time,
                    end_time_ms=run.info.end_time,
                )
            )
        token = page.token
        if not token:
            break
    records.sort(key=lambda r: (r.start_time_ms or 0, r.run_id))
    return records


def split_finished(runs: list[RunRecord], experiment: str = "") -> tuple[list[RunRecord], list[RunRecord]]:
    """(FINISHED runs, all others). Raises ReportError naming ``experiment`` if none finished."""
    finished = [r for r in runs if r.status == "FINISHED"]
    others = [r for r in runs if r.status != "FINISHED"]
    if not finished:
        counts = {s: sum(r.status == s for r in others) for s in sorted({r.status for r in others})}
        raise ReportError(f"experiment {experiment!r} has no FINISHED runs (other runs by status: {counts})")
    return finished, others
