"""A real MLflow tracking server on 127.0.0.1 for tests (SQLite behind it), started and stopped cleanly."""

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
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (uvicorn workers included), SIGKILL after 20 s."""
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
def mlflow_server(root: Path, timeout: float = 180) -> Iterator[str]:
    """``mlflow server`` with its store, artifacts and log under ``root``; yields its http:// URI."""
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--backend-store-uri", f"sqlite:///{root / 'server.db'}", "--workers", "1"]
    cmd += ["--artifacts-destination", str(root / "server-artifacts")]
    log_path = root / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            uri = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + timeout
            while True:
                try:
                    with urllib.request.urlopen(f"{uri}/health", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"mlflow server did not answer /health:\n{log_path.read_text()}")
                time.sleep(0.5)
            yield uri
        finally:
            _stop_group(server)
