"""A local MLflow tracking server on 127.0.0.1 (SQLite behind it), started and stopped cleanly.

Several processes writing one SQLite file directly can hit "database is locked"; a sweep whose jobs
run in parallel logs through one server instead. ``local_mlflow_server(root)`` starts
``mlflow server`` with its store (``mlflow.db``), artifacts (``mlartifacts/``) and log
(``mlflow-server.log``) under ``root`` on a free port, waits until ``/health`` answers, yields its
``http://`` URI and stops the server's whole process group when the block ends (errors and Ctrl+C
included). ``tools/paper_protocol.py`` and the tests use it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from http.client import HTTPException
from pathlib import Path

STORE = "mlflow.db"
ARTIFACTS = "mlartifacts"
LOG = "mlflow-server.log"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(root: Path, port: int | str) -> list[str]:
    """``mlflow server`` on 127.0.0.1:``port`` with its SQLite store and artifacts under ``root``."""
    root = Path(root).resolve()
    return [
        *(sys.executable, "-m", "mlflow", "server"),
        *("--backend-store-uri", f"sqlite:///{root / STORE}"),
        *("--artifacts-destination", str(root / ARTIFACTS)),
        *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
    ]


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (its uvicorn workers included), SIGKILL after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def local_mlflow_server(root: Path, timeout: float = 300) -> Iterator[str]:
    """``mlflow server`` on a free 127.0.0.1 port with its files under ``root``; yields its http:// URI.

    RuntimeError naming the server's log when it exits or does not answer ``/health`` within ``timeout``
    seconds.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = root / LOG
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner processes
    with open(log_path, "w") as log:
        # Its own session: a Ctrl+C in the terminal does not reach it mid-sweep; it is stopped below.
        proc = subprocess.Popen(
            server_command(root, port), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        uri = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            with (
                contextlib.suppress(OSError, HTTPException),
                urllib.request.urlopen(f"{uri}/health", timeout=2) as resp,
            ):
                if resp.status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not answer {uri}/health; its log: {log_path}")
            time.sleep(0.5)
        yield uri
    finally:
        _stop_group(proc)
