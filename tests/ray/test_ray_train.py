"""``ais-train algorithm.max_staleness=2 workers=ray`` end to end on a local Ray cluster: it trains, resumes from its
checkpoint with the workers restarted from the checkpoint's weights and the versions continued, and neither a
finished run, nor SIGTERM, nor Ctrl-C leaves a Ray process behind."""

from __future__ import annotations

import csv
import json
import signal
import time
from pathlib import Path

import pytest

from tests.ray.helpers import ray_processes
from tests.reliability.runs import SMOKE, Run

pytestmark = pytest.mark.slow

RAY = [*SMOKE, "algorithm.max_staleness=2", "workers=ray", "logger=csv", "trainer.checkpoint_every_n_steps=1"]


def _no_ray_left(before: set[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes left behind: {sorted(left)}"


def _history(out: Path) -> list[dict]:
    return json.loads((out / "history.json").read_text())


def test_train_resume_and_signals_leave_no_ray_process(tmp_path):
    before = ray_processes()
    out = tmp_path / "run"
    first = Run([*RAY, "trainer.max_steps=3", f"hydra.run.dir={out}"], tmp_path, log_name="first").expect(
        0, timeout=900
    )
    assert "rollout workers       the trainer waited" in first.output  # the summary's line of the workers
    _no_ray_left(before)
    history = _history(out)
    assert [h["step"] for h in history] == [1.0, 2.0, 3.0]
    assert [h["staleness"] for h in history][0] == 0.0 and all(h["staleness"] <= 2 for h in history)
    rows = list(csv.DictReader(open(next(out.glob("csv/**/metrics.csv")))))
    assert any(r.get("async/queue_depth") not in (None, "") for r in rows)
    assert any(r.get("async/worker_tokens_per_s") not in (None, "") for r in rows)
    assert any(r.get("async/publish_s") not in (None, "") for r in rows)  # the update's weights, put once

    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        steps = len(list((out / "checkpoints").glob("step*.ckpt")))
        run = Run(
            [*RAY, "ckpt_path=last", "trainer.max_steps=500", f"hydra.run.dir={out}"],
            tmp_path,
            log_name=sig.name,
        )
        run.wait_for(
            out / "checkpoints" / f"step{steps + 1:06d}.ckpt", timeout=900
        )  # a step after the resume
        run.kill(sig)
        run.expect(code, timeout=300)
        _no_ray_left(before)

    Run([*RAY, "ckpt_path=last", f"trainer.max_steps={steps + 3}", f"hydra.run.dir={out}"], tmp_path).expect(
        0, 900
    )
    _no_ray_left(before)
    history = _history(out)
    assert [h["step"] for h in history] == [
        float(s) for s in range(1, len(history) + 1)
    ]  # the versions go on
    assert len(history) == steps + 3 and all(h["staleness"] <= 2 for h in history)
