"""A kill at any moment of a checkpoint write leaves a run that ``ckpt_path=last`` resumes (issue #33, case 2).

``last.ckpt`` is overwritten at every save; a ``kill -9`` between the new file and its new hash used to leave
the new file beside the old hash, and ``ckpt_path=last`` refused the run as corrupt (2 of 5 real kills).

A kill is modelled exactly and deterministically: every file-system step of the checkpoint writes
(``ais_lightning.files``: a file created, its first bytes written, a rename, a removal) is followed by a
snapshot of the checkpoint directory, which is what a ``kill -9`` right after that step leaves on disk (no
clean-up runs; published files are never modified in place, so hard links keep their content). A resume then
starts from each snapshot.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ais_lightning.files import VerifiedCheckpointIO
from tests.reliability.faults import after_file_steps
from tests.reliability.runs import SMOKE, metric_by_step, mlflow_runs


class _Recorder:
    """Snapshots of ``directory`` (and copies of ``extra`` files) after every mutating step of ``files``."""

    def __init__(self, directory: Path, out: Path, extra: tuple[Path, ...] = ()) -> None:
        self.directory, self.out, self.extra = directory, out, extra
        self.moments: list[Path] = []
        self.save_ends: list[int] = []  # how many moments there were when each checkpoint save returned

    def snapshot(self) -> None:
        dest = self.out / f"{len(self.moments):04d}"
        (dest / "checkpoints").mkdir(parents=True)
        for path in self.directory.iterdir() if self.directory.exists() else []:
            if path.name.endswith(".tmp"):  # being written: its bytes as they are now
                shutil.copyfile(path, dest / "checkpoints" / path.name)
            else:  # published files are replaced by renames, never rewritten: a link keeps this version
                os.link(path, dest / "checkpoints" / path.name)
        for path in self.extra:
            if path.exists():
                shutil.copyfile(path, dest / path.name)
        self.moments.append(dest)

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Recorder]:
        """Record while the block runs; the recording patches are undone after it (only they: a test's own
        environment stays as the test set it)."""
        recorder = self

        save = VerifiedCheckpointIO.save_checkpoint

        def recording_save(io: Any, *args: Any, **kwargs: Any) -> None:
            save(io, *args, **kwargs)
            recorder.save_ends.append(len(recorder.moments))

        with pytest.MonkeyPatch.context() as patch, after_file_steps(self.snapshot):
            patch.setattr(VerifiedCheckpointIO, "save_checkpoint", recording_save)
            self.snapshot()  # before the first step
            yield self


def _restore(moment: Path, directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(moment / "checkpoints", directory)


def _checkpoint(step: int, last: bool) -> dict[str, Any]:
    return {"global_step": step, "last": last, "weights": torch.full((2048,), float(step))}


def test_every_moment_of_a_checkpoint_write_leaves_a_checkpoint_that_verifies(tmp_path: Path):
    """``ModelCheckpoint``'s sequence (``stepN.ckpt`` then ``last.ckpt``, overwritten) through the checkpoint IO,
    a kill after each of its steps: ``ckpt_path=last`` always finds a complete checkpoint that verifies, never
    older than the last save that returned, and says so when it skips a newer one."""
    from ais_lightning.app.resume import resolve_checkpoint

    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    io = VerifiedCheckpointIO()
    saves = [(f"step{s:06d}.ckpt", s, False) for s in (1, 2, 3)]
    sequence = [item for s in saves for item in (s, ("last.ckpt", s[1], True))]
    with _Recorder(ckpts, tmp_path / "moments").installed() as recorder:
        for name, step, last in sequence:
            io.save_checkpoint(_checkpoint(step, last), ckpts / name)
            time.sleep(
                0.02
            )  # a training step between saves: file times (a clock tick apart at least) order them
    first_done = recorder.save_ends[0]
    for index in range(first_done, len(recorder.moments)):
        _restore(recorder.moments[index], ckpts)
        path = resolve_checkpoint("last", str(run))
        state = VerifiedCheckpointIO().load_checkpoint(path)  # verifies again, then loads
        done = sum(end <= index for end in recorder.save_ends)  # saves that had returned at this moment
        newest_done = sequence[done - 1][1]
        assert state["global_step"] >= newest_done, (index, path, state["global_step"])
        assert torch.equal(state["weights"], torch.full((2048,), float(state["global_step"]))), (index, path)
    assert len(recorder.moments) - first_done >= 40, "moments after the first checkpoint is published"
    # and nothing unverified or half written is left by the saves that completed
    names = ["last.ckpt", "step000001.ckpt", "step000002.ckpt", "step000003.ckpt"]
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([*names, *(f"{n}.sha256" for n in names)])


def test_last_falls_back_to_the_newest_checkpoint_that_verifies_and_says_why(tmp_path: Path, caplog):
    from ais_lightning.app.resume import resolve_checkpoint
    from ais_lightning.files import write_hash

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    older, last = ckpts / "step000006.ckpt", ckpts / "last.ckpt"
    older.write_bytes(b"step 6")
    write_hash(older)
    last.write_bytes(b"step 5")
    write_hash(last)
    last.write_bytes(b"step 7")  # new content beside the old hash (what an in-place overwrite left)
    os.utime(older, ns=(10**9, 10**9))
    with caplog.at_level("WARNING", logger="ais_lightning.app.train"):
        assert resolve_checkpoint("last", str(tmp_path)) == str(older)
    assert "step000006.ckpt" in caplog.text and "last.ckpt" in caplog.text and "does not match" in caplog.text
    older.write_bytes(b"damaged")
    with pytest.raises(ValueError, match=r"no checkpoint .* verifies: ") as err:
        resolve_checkpoint("last", str(tmp_path))
    assert "last.ckpt: content hash" in str(err.value) and "step000006.ckpt: content hash" in str(err.value)


@pytest.mark.slow
def test_killed_at_20_moments_of_checkpoint_writes_every_resume_continues_the_mlflow_run(
    tmp_path: Path, in_process
):
    """The acceptance test: a real 2-step ``ais-train`` run (MLflow on its default SQLite store), killed at 20
    moments spread over its checkpoint writes after the first checkpoint; each time ``ckpt_path=last`` resumes,
    finishes, and continues the same MLflow run."""
    out = tmp_path / "run"
    db = out / "mlflow.db"
    common = [*SMOKE, "trainer.checkpoint_every_n_steps=1", "logger=mlflow", f"output_dir={out}"]
    with _Recorder(out / "checkpoints", tmp_path / "moments", extra=(db,)).installed() as rec:
        in_process(common)
    (original,) = mlflow_runs(db)
    eligible = list(range(rec.save_ends[0], len(rec.moments)))  # a checkpoint had been published
    picked = [eligible[round(i * (len(eligible) - 1) / 19)] for i in range(20)]
    resumed_from = set()
    for index in picked:
        moment = rec.moments[index]
        _restore(moment, out / "checkpoints")
        with open(db, "r+b") as f:  # the store as it was at that moment, in place
            f.write((moment / "mlflow.db").read_bytes())
            f.truncate()
        summary = in_process([*common, "ckpt_path=last"])
        assert summary["status"] == "finished" and summary["steps"] == 2, (index, summary)
        (record,) = mlflow_runs(db)
        assert record.info.run_id == original.info.run_id, f"moment {index}: a new MLflow run"
        assert record.info.status == "FINISHED", (index, record.info)
        tags = [k for k in record.data.tags if k.startswith("resumed_at_step_")]
        assert len(tags) == 1, (index, tags)
        resumed_from.add(tags[0])
        assert list(metric_by_step(db, record.info.run_id, "reward/mean")) == [0, 1], index
    assert resumed_from == {"resumed_at_step_1", "resumed_at_step_2"}, resumed_from
    assert len(set(picked)) == 20, f"20 distinct moments, from {len(eligible)}"
