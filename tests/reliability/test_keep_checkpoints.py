"""``trainer.keep_checkpoints``: only the N newest periodic checkpoints stay on disk, each with its hash, through a
resume; ``last.ckpt`` always stays."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ais_lightning.files import verify_file
from tests.reliability.runs import SMOKE, Run

pytestmark = pytest.mark.slow


def _checkpoints(run_dir: Path) -> set[str]:
    return {p.name for p in (run_dir / "checkpoints").iterdir()}


def _kept(*steps: int) -> set[str]:
    names = [*(f"step{s:06d}.ckpt" for s in steps), "last.ckpt"]
    return {*names, *(f"{n}.sha256" for n in names)}


def test_the_newest_periodic_checkpoints_stay_through_a_resume(tmp_path: Path):
    run_dir = tmp_path / "run"
    common = [
        *SMOKE,
        "trainer.checkpoint_every_n_steps=1",
        "trainer.keep_checkpoints=2",
        "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    first = Run([*common, "trainer.max_steps=4"], tmp_path, log_name="first").expect(0)
    assert _checkpoints(run_dir) == _kept(3, 4)
    # the size the run estimated before training, against the checkpoint it wrote
    estimate = float(re.search(r"checkpoints: about ([0-9.]+) MB each, at most 4 at once", first.output)[1])
    written = (run_dir / "checkpoints" / "step000004.ckpt").stat().st_size / 1e6
    assert written * 0.9 < estimate < written * 1.1, (estimate, written)

    # the resumed run knows the checkpoints it kept (Lightning's callback state): steps 3 and 4 go in turn
    Run([*common, "trainer.max_steps=6", "ckpt_path=last"], tmp_path, log_name="resumed").expect(0)
    assert _checkpoints(run_dir) == _kept(5, 6)
    for name in ("step000005.ckpt", "step000006.ckpt", "last.ckpt"):
        verify_file(run_dir / "checkpoints" / name)
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 6
