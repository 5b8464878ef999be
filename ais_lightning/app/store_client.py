"""The MLflow client a run logs through: the store's lock (SQLite), and a bounded wait for a tracking server.

- :func:`store_lock`: one lock per SQLite store file, held around every store call, so the jobs of a parallel
  sweep writing one ``mlflow.db`` never create the schema or write at the same instant.
- :func:`request_budget`: MLflow retries a request to a server that does not answer 7 times with a doubling
  backoff and waits up to 120 s for each answer; every store call of a run whose server died then took minutes
  (over 8 minutes before a run gave up, with no training). During a run the budget is
  ``logger.request_retries`` (default 3) and ``logger.request_timeout_s`` (default 20 s): a dead server (refused
  connections) is given up on in under 10 s, one that hangs in under 2 minutes.
- :class:`StoreClient`: the client with both; once a server stopped answering within its budget, every later
  call fails at once with :class:`TrackingServerLost` naming the server, instead of spending the budget again
  in each of the run's closing calls.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_RETRIES = 3
"""Retries of one request to a tracking server during a run (``logger.request_retries``)."""
DEFAULT_TIMEOUT_S = 20
"""Seconds a tracking server has to answer one request during a run (``logger.request_timeout_s``)."""
BACKOFF_FACTOR = 1
"""urllib3's backoff between retries: 0, 2, 4 ... seconds (MLflow's default 2 doubles them)."""


@contextlib.contextmanager
def store_lock(lock_path: Path | None) -> Iterator[None]:
    """An exclusive lock on ``lock_path`` held across processes (``filelock``); no-op for None.

    Several processes writing one SQLite MLflow store (a parallel sweep on the default store) fail when
    two of them create the schema at once (``duplicate column name``, alembic "Online migration
    expected to match one row") or write at once ("database is locked"); holding this lock around every
    store call serializes them. The lock is re-entrant within a thread (one ``FileLock`` per path and
    process): a store call made while this thread already holds it (from a callback inside another store
    call, or a signal handler that interrupted one) goes on instead of waiting for itself for ever.
    """
    if lock_path is None:
        yield
        return
    from filelock import FileLock

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock_path, is_singleton=True):
        yield


@contextlib.contextmanager
def request_budget(retries: int | None, timeout_s: int | None) -> Iterator[dict[str, str]]:
    """MLflow's HTTP retry budget for the block (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``..._BACKOFF_FACTOR``,
    ``..._TIMEOUT``, which MLflow reads at every request): ``retries`` / ``timeout_s``, else the environment's
    values, else :data:`DEFAULT_RETRIES` / :data:`DEFAULT_TIMEOUT_S`. The environment is restored after. Yields
    the values in effect."""
    values = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": retries,
        "MLFLOW_HTTP_REQUEST_TIMEOUT": timeout_s,
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": None,
    }
    defaults = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": DEFAULT_RETRIES,
        "MLFLOW_HTTP_REQUEST_TIMEOUT": DEFAULT_TIMEOUT_S,
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": BACKOFF_FACTOR,
    }
    before = {name: os.environ.get(name) for name in values}
    effective = {
        name: str(value if value is not None else before[name] or defaults[name])
        for name, value in values.items()
    }
    os.environ.update(effective)
    try:
        yield effective
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class TrackingServerLost(RuntimeError):
    """The run's MLflow tracking server did not answer within the run's retry budget."""

    def __init__(self, server: str, cause: BaseException) -> None:
        self.server = server
        retries, timeout = (os.environ.get(f"MLFLOW_HTTP_REQUEST_{k}") for k in ("MAX_RETRIES", "TIMEOUT"))
        super().__init__(
            f"the MLflow tracking server {server} stopped answering ({retries} retries, {timeout} s per "
            f"request: logger.request_retries, logger.request_timeout_s): {_clip(str(cause), 240)}"
        )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _server_unreachable(err: BaseException) -> bool:
    """Whether ``err`` (or what it was raised from or during) is a failure to reach the server: no connection,
    a timeout, or retries spent (``requests``' errors, which MLflow re-raises as an ``MlflowException``)."""
    import requests

    from ais_lightning.files import find_cause

    return find_cause(err, lambda e: isinstance(e, requests.exceptions.RequestException)) is not None


class StoreClient:
    """An ``MlflowClient`` whose every call holds the store lock (``lock_path``; SQLite stores) and, for a
    tracking ``server``, fails at once with :class:`TrackingServerLost` once one call found it gone."""

    def __init__(self, client: Any, lock_path: Path | None, server: str | None = None) -> None:
        self._client, self._lock_path, self._server = client, lock_path, server
        self.lost: TrackingServerLost | None = None
        """Why the server was given up on; None while it answers."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.lost is not None:  # the same error again, without spending the budget again
                raise TrackingServerLost(self.lost.server, self.lost.__cause__ or self.lost)
            with store_lock(self._lock_path):
                try:
                    return attr(*args, **kwargs)
                except Exception as err:
                    if self._server is None or not _server_unreachable(err):
                        raise
                    self.lost = TrackingServerLost(self._server, err)
                    raise self.lost from err

        return call
