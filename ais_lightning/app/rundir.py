"""One writer per run directory: a lock held for the whole run, and no fresh run over another run's checkpoints.

Two ``ais-train`` processes in one ``hydra.run.dir`` interleave their checkpoints and overwrite each other's
summary, config and history; a fresh run in a directory that holds checkpoints replaces them silently. A run
therefore holds ``<output_dir>/run.lock`` (``filelock``; released by the system if the process dies) from
before anything is built to its end, and writes who holds it to ``run.lock.json`` beside it: a second run in
the directory is refused naming the holder. A fresh run (no ``ckpt_path``) in a directory that holds
checkpoints is refused unless ``overwrite=true`` (the old checkpoints are deleted first) or it resumes
(``ckpt_path=last``; a requeued SLURM job resumes by itself, :func:`ais_lightning.app.preemption.requeued`).

Only the process that launched the run takes the lock (:func:`launching_rank`): the other ranks of a
multi-process run work in the same directory.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

LOCK_NAME = "run.lock"
"""The lock file of a run directory."""
HOLDER_NAME = "run.lock.json"
"""Who holds the lock: ``{"pid", "host", "started", "command"}``, written once the lock is taken."""
DIRNAME_BYTES = 160
"""The longest sweep job directory name :func:`fitting_dirname` gives (file systems allow 255 bytes per name)."""


def fitting_dirname(name: str, limit: int = DIRNAME_BYTES) -> str:
    """``name`` (Hydra's ``override_dirname``: a sweep job's overrides) as a directory name of at most ``limit``
    bytes: unchanged when it fits, else its first bytes, ``_`` and 10 hex digits of its SHA-1, so two long
    names that share a prefix still get two directories. ``ais-train`` names each sweep job's directory
    ``<job number>_${fit_dirname:...}``: a sweep with many overrides would otherwise fail with "File name too
    long" before its first run."""
    raw = name.encode()
    if len(raw) <= limit:
        return name
    digest = hashlib.sha1(raw).hexdigest()[:10]
    return raw[: limit - len(digest) - 1].decode(errors="ignore") + "_" + digest


class RunDirectoryInUse(ValueError):
    """Another process holds the run directory's lock."""


def launching_rank() -> int:
    """This process's global rank as the launcher set it (``RANK``, ``LOCAL_RANK`` of a single-node launch,
    ``SLURM_PROCID``), read before any process group exists; 0 for a plain process."""
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return 0


def _holder_text(directory: Path) -> str:
    """``pid 123 on host h since <time>: <command>``, from the holder file; a plain note when it cannot be read."""
    try:
        holder = json.loads((directory / HOLDER_NAME).read_text())
        return (
            f"pid {holder['pid']} on host {holder['host']} since {holder['started']}: "
            f"{' '.join(holder['command'])}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return f"a process whose {HOLDER_NAME} is not written yet"


@contextmanager
def run_directory_lock(output_dir: str | os.PathLike) -> Iterator[None]:
    """Hold ``<output_dir>/run.lock`` for the block (launching rank only, :func:`launching_rank`); raise
    :class:`RunDirectoryInUse` naming the holder when another process holds it."""
    if launching_rank() != 0:
        yield
        return
    from filelock import FileLock, Timeout

    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    lock = FileLock(directory / LOCK_NAME)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise RunDirectoryInUse(
            f"output_dir {directory} is in use by another ais-train run ({_holder_text(directory)}); two runs in "
            "one directory would overwrite each other's checkpoints, summary and config: wait for it to end, "
            "or give this run another hydra.run.dir"
        ) from None
    try:
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        }
        (directory / HOLDER_NAME).write_text(json.dumps(holder) + "\n")
        yield
    finally:
        with suppress(OSError):
            (directory / HOLDER_NAME).unlink()
        lock.release()


def existing_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The checkpoints a run left in ``output_dir``: ``checkpoints/*.ckpt`` (periodic, ``last``, ``hpc_ckpt_N``)
    and ``hpc_ckpt_*.ckpt`` at its top (where Lightning's own SLURM handler writes them)."""
    directory = Path(output_dir)
    return sorted([*directory.glob("checkpoints/*.ckpt"), *directory.glob("hpc_ckpt_*.ckpt")])


def check_fresh_start(output_dir: str | os.PathLike, overwrite: bool) -> None:
    """A fresh run (no ``ckpt_path``) in ``output_dir``: refused, naming what is there, when the directory holds
    checkpoints, unless ``overwrite`` (they are then deleted, each with its hash sidecar)."""
    from ais_lightning.files import discard_dir, hash_path

    found = existing_checkpoints(output_dir)
    if not found or launching_rank() != 0:
        return
    if not overwrite:
        names = ", ".join(str(p.relative_to(output_dir)) for p in found[:4])
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        raise ValueError(
            f"output_dir {output_dir} already holds checkpoints of a run ({names}{more}) and this run does not "
            "resume it: resume it with ckpt_path=last, start over in it with overwrite=true (its checkpoints "
            "are deleted), or give this run another hydra.run.dir"
        )
    discard_dir(Path(output_dir) / "checkpoints")
    for path in found:
        for stale in (path, hash_path(path)):
            with suppress(FileNotFoundError):
                stale.unlink()
