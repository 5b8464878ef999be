"""The locks a run takes (issue 45 case 1's re-entrant store lock and case 5's run-directory lock; issue 47's
``filelock``): exclusive across processes, re-entrant for the thread that holds the store lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TRY_LOCK = """
import sys
from filelock import FileLock, Timeout
try:
    FileLock(sys.argv[1]).acquire(timeout=0)
except Timeout:
    sys.exit(3)
"""


def another_process_gets(lock_file: Path) -> bool:
    """Whether a fresh process takes ``lock_file`` at once."""
    code = subprocess.run([sys.executable, "-c", TRY_LOCK, str(lock_file)], timeout=120).returncode
    assert code in (0, 3), code
    return code == 0


@pytest.mark.timeout(60, method="signal")  # the fcntl lock it replaced waited for itself for ever here
def test_the_store_lock_is_reentrant_in_its_thread_and_exclusive_across_processes(tmp_path: Path):
    from ais_lightning.app.tracking import store_lock  # (where the run takes it from)

    lock_file = tmp_path / "mlflow.db.lock"
    with store_lock(lock_file):
        with store_lock(lock_file):  # a store call made inside another (a callback, a signal handler)
            assert not another_process_gets(lock_file)
        assert not another_process_gets(lock_file)
    assert another_process_gets(lock_file)


def test_a_run_directory_is_held_for_one_run_and_its_holder_named(tmp_path: Path):
    from ais_lightning.app.rundir import HOLDER_NAME, LOCK_NAME, RunDirectoryInUse, run_directory_lock

    with run_directory_lock(tmp_path):
        assert not another_process_gets(tmp_path / LOCK_NAME)
        with pytest.raises(RunDirectoryInUse, match=r"is in use by another ais-train run \(pid \d+ on host"):
            with run_directory_lock(tmp_path):
                pass
    assert not (tmp_path / HOLDER_NAME).exists() and another_process_gets(tmp_path / LOCK_NAME)


def test_a_cache_entry_is_built_by_one_process_at_a_time(tmp_path: Path):
    from ais_lightning.files import entry_lock

    with entry_lock(tmp_path, "key", "warm start"):
        assert not another_process_gets(tmp_path / ".key.lock")
    assert another_process_gets(tmp_path / ".key.lock")
