"""A sweep whose overrides make a directory name longer than the file system allows runs (it failed with
"File name too long" before its first job): each job's directory name is Hydra's override_dirname, shortened and
hashed when it does not fit (``ais_lightning.app.rundir.fitting_dirname``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ais_lightning.app.rundir import DIRNAME_BYTES, fitting_dirname
from tests.reliability.runs import Run


def test_a_name_that_fits_is_kept_and_a_long_one_is_cut_and_hashed():
    assert fitting_dirname("corrector=tis,rollout=fp4") == "corrector=tis,rollout=fp4"
    long = "algorithm.rollout_lag=[0,1,2,3,4]," * 10  # 340 bytes
    short = fitting_dirname(long)
    digest = hashlib.sha1(long.encode()).hexdigest()[:10]
    assert len(short.encode()) == DIRNAME_BYTES and short.endswith("_" + digest)
    assert short.startswith(long[: DIRNAME_BYTES - 11])
    assert fitting_dirname(long + "x") != short  # same prefix, another name: another directory
    accented = "é" * 200  # 400 bytes: never cut inside a character
    assert len(fitting_dirname(accented).encode()) <= DIRNAME_BYTES
    fitting_dirname(accented).encode().decode()


def test_a_sweep_with_long_overrides_runs(tmp_path: Path):
    long = [
        "algorithm.max_staleness=4",
        "algorithm.rollout_lag=[0,1,2,3,4]",
        "algorithm.rollout_lag_random=true",
        "algorithm.adaptive_staleness=true",
        "logger.experiment_name=a_sweep_with_a_long_experiment_name",
        "trainer.enable_progress_bar=false",
        "trainer.num_threads=1",
    ]
    args = ["-m", "experiment=smoke", "logger=csv", "trainer.max_steps=1", "corrector=tis,ais", *long]
    args.append(f"hydra.sweep.dir={tmp_path / 'sweep'}")
    Run(args, tmp_path).expect(0, timeout=600)
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert [j.split("_", 1)[0] for j in jobs] == ["0", "1"]
    assert all(len(j.encode()) <= len("1_") + DIRNAME_BYTES for j in jobs)
    assert all((tmp_path / "sweep" / j / "summary.json").is_file() for j in jobs)
