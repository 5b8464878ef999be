"""The README's parallel sweep lands in one directory and one MLflow store (issue #33, case 1).

The sweep directory's name carries the process id; each joblib worker used to resolve it itself, so a
sweep of three jobs left three directories and two SQLite stores (exit 0). The command is read from the
README and run as written, with the README's seconds-long run (``experiment=smoke logger=mlflow``) appended
and without ``hydra.sweep.dir`` (setting it hides the bug).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.reliability.runs import REPO, Run, mlflow_runs

pytestmark = pytest.mark.slow


def _readme_command(fragment: str) -> list[str]:
    """The arguments of the README's ``ais-train`` command line containing ``fragment`` (comment removed)."""
    lines = [
        line
        for line in (REPO / "README.md").read_text().splitlines()
        if line.startswith("ais-train ") and fragment in line
    ]
    assert lines, f"the README shows no ais-train command with {fragment!r}"
    return shlex.split(re.sub(r"\s+#.*$", "", lines[0]))[1:]


def test_the_readme_parallel_sweep_leaves_one_directory_and_one_store(tmp_path: Path):
    sweep = _readme_command("hydra/launcher=joblib")
    tiny = _readme_command("experiment=smoke")
    assert "hydra.launcher.n_jobs=2" in sweep and not any(a.startswith("hydra.sweep.dir") for a in sweep)
    run = Run([*sweep, *tiny], tmp_path)
    run.expect(0, timeout=1200)

    dirs = [d for day in (tmp_path / "multirun").iterdir() for d in day.iterdir()]
    assert len(dirs) == 1, f"one sweep directory, got {sorted(str(d) for d in dirs)}"
    stores = sorted(tmp_path.rglob("mlflow.db"))
    assert stores == [dirs[0] / "mlflow.db"], f"one store under the sweep directory, got {stores}"
    corrector = next(a for a in sweep if a.startswith("corrector="))
    expected = corrector.split("=", 1)[1].split(",")
    runs = mlflow_runs(stores[0])
    assert sorted(r.data.params["corrector"] for r in runs) == sorted(expected)
    assert {r.info.status for r in runs} == {"FINISHED"}
    jobs = sorted(p.name.split("_", 1)[0] for p in dirs[0].iterdir() if p.is_dir() and p.name[0].isdigit())
    assert jobs == [str(i) for i in range(len(expected))], (
        "every job's directory under the one sweep directory"
    )
