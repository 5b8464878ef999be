"""A tracking server that dies mid-run (issue 45, case 8), with a real ``mlflow server`` on 127.0.0.1.

MLflow's client retried every request 7 times with a doubling backoff and waited up to 120 s for each answer:
a run whose server died spent over 8 minutes in retries, without training and without a summary. Now a run
gives the server a bounded budget (``logger.request_retries``, ``logger.request_timeout_s``), then stops with
one message naming the server, its checkpoints verified and the way to resume.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ais_lightning.files import verify_file
from tests.mlflow_server import mlflow_server
from tests.reliability.runs import SMOKE, Run

pytestmark = pytest.mark.slow


def test_a_tracking_server_that_dies_mid_run_ends_the_run_in_seconds_naming_it(tmp_path: Path):
    out = tmp_path / "run"
    args = [*SMOKE, "trainer.max_steps=40", "trainer.checkpoint_every_n_steps=1", "logger=mlflow"]
    with mlflow_server(tmp_path / "server") as uri:
        run = Run([*args, f"logger.tracking_uri={uri}", f"hydra.run.dir={out}"], tmp_path)
        run.wait_for(out / "checkpoints" / "step000001.ckpt.sha256")
    stopped = time.monotonic()  # the server's process group is gone: connections are refused
    code = run.wait(timeout=400)
    took = time.monotonic() - stopped
    assert code == 1, run.output[-4000:]
    assert f"the MLflow tracking server {uri} stopped answering (3 retries, 20 s per request" in run.stderr, (
        run.stderr[-4000:]
    )
    assert "Resume with ckpt_path=last once the server answers again" in run.stderr
    assert took < 120, f"{took:.0f} s between the server's end and the run's"
    checkpoints = sorted((out / "checkpoints").glob("step*.ckpt"))
    assert checkpoints and len(checkpoints) < 40, "the run stopped training"
    for path in checkpoints:
        verify_file(path)
