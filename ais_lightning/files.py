"""Verified files: written atomically, published with a SHA-256 sidecar, checked on every load.

A file ``X`` we write is first written under a temporary name in its own directory, flushed to disk
and renamed onto ``X`` (``os.replace`` is atomic on POSIX and Windows), so a reader never sees half a
file. Its SHA-256 is then written the same way to ``X.sha256`` in ``sha256sum`` format
(``<hex>  <name>``), *after* ``X`` itself: a crash between the two leaves a file without a hash,
which loading treats as incomplete rather than trusting it. Loading recomputes the hash and raises
:class:`CorruptFileError` (a ``ValueError``) naming the file when the sidecar is missing, malformed or
different, so flipped bytes or a truncated file are never loaded silently.

A directory of such files (e.g. a warm-start cache entry) is built under a temporary name and
published by one atomic rename (:func:`publish_dir`); :func:`discard_dir` moves a bad one out of the
way before deleting it, so no other process ever sees it half deleted under its real name. Caches of
such entries live under :func:`cache_root`, and :func:`entry_lock` makes concurrent processes build
one entry once (the others wait, then read it).

:class:`VerifiedCheckpointIO` brings the same guarantee to Lightning checkpoints: a
``TorchCheckpointIO`` (``lightning/fabric/plugins/io/torch_io.py``: ``_atomic_save`` to the path,
``torch.load`` back) that writes the sidecar after each save, verifies it before each load and
removes it with the checkpoint. Strategies that do not go through ``CheckpointIO`` (Lightning's
``ModelParallelStrategy``/FSDP2 with distributed checkpoints, which write a directory) are not covered.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

HASH_SUFFIX = ".sha256"
"""Sidecar suffix: the hash of ``X`` lives in ``X.sha256``."""

log = logging.getLogger(__name__)

_SIDECAR_RE = re.compile(r"^([0-9a-f]{64})(?:\s+\*?.*)?\s*$")
_CHUNK = 1 << 20


class CorruptFileError(ValueError):
    """A verified file is missing, has no (valid) hash sidecar, or does not match its hash."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


def hash_path(path: str | os.PathLike) -> Path:
    """Where the SHA-256 of ``path`` is stored: ``<path>.sha256``."""
    path = Path(path)
    return path.with_name(path.name + HASH_SUFFIX)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (best effort; not possible on every platform)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it onto ``path``.

    The temporary file is removed if ``write`` raises; ``path`` is then untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # open() honours the umask
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_hash(path: str | os.PathLike) -> str:
    """Hash the file at ``path`` as it is on disk and write the sidecar atomically; returns the hex."""
    path = Path(path)
    digest = sha256_file(path)
    atomic_write(hash_path(path), lambda f: f.write(f"{digest}  {path.name}\n".encode()))
    return digest


def read_hash(path: str | os.PathLike) -> str:
    """The hex SHA-256 recorded for ``path``; CorruptFileError if the sidecar is missing or malformed."""
    sidecar = hash_path(path)
    try:
        text = sidecar.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        raise CorruptFileError(path, f"no hash file {sidecar.name} beside it (incomplete write?)") from None
    match = _SIDECAR_RE.match(text.lower())
    if match is None:
        raise CorruptFileError(path, f"hash file {sidecar.name} is malformed: {text[:80]!r}")
    return match.group(1)


def verify_file(path: str | os.PathLike) -> str:
    """Check ``path`` against its sidecar; returns the hex, or raises CorruptFileError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CorruptFileError(path, "file is missing")
    expected = read_hash(path)
    actual = sha256_file(path)
    if actual != expected:
        raise CorruptFileError(
            path,
            f"content hash {actual[:16]}... does not match {hash_path(path).name} ({expected[:16]}...): "
            "the file is corrupt or was modified after it was written",
        )
    return actual


def save_verified(obj: Any, path: str | os.PathLike) -> str:
    """``torch.save(obj)`` to ``path`` atomically, then its sidecar; returns the hex SHA-256."""
    atomic_write(path, lambda f: torch.save(obj, f))
    return write_hash(path)


def load_verified(path: str | os.PathLike, **torch_load_kwargs: Any) -> Any:
    """Verify ``path`` against its sidecar, then ``torch.load`` it (``weights_only=True`` unless given).

    Raises CorruptFileError before unpickling anything that does not match its hash.
    """
    verify_file(path)
    torch_load_kwargs.setdefault("weights_only", True)
    torch_load_kwargs.setdefault("map_location", "cpu")
    return torch.load(path, **torch_load_kwargs)


def write_text_verified(path: str | os.PathLike, text: str) -> str:
    """Write UTF-8 ``text`` atomically, then its sidecar; returns the hex SHA-256."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    return write_hash(path)


def read_text_verified(path: str | os.PathLike) -> str:
    """Verify ``path`` against its sidecar, then return its UTF-8 text."""
    verify_file(path)
    return Path(path).read_text(encoding="utf-8")


def make_temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new empty hidden directory ``parent/.<prefix>-<random>`` (mode from the umask, unlike mkdtemp)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / f".{prefix}-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    return path


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> bool:
    """Rename the finished directory ``tmp`` to ``final`` atomically.

    Returns False (and deletes ``tmp``) when ``final`` already exists, e.g. because another process
    published the same entry first; ``final`` is never overwritten.
    """
    tmp, final = Path(tmp), Path(final)
    try:
        os.rename(
            tmp, final
        )  # fails on an existing non-empty directory (POSIX) or any existing one (Windows)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    _fsync_dir(final.parent)
    return True


def discard_dir(path: str | os.PathLike) -> None:
    """Move ``path`` to a unique hidden name beside it, then delete it (a no-op if it is gone)."""
    path = Path(path)
    trash = path.with_name(f".{path.name}.discarded-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)


def cache_root() -> Path:
    """Root of every on-disk cache: ``$AIS_LIGHTNING_CACHE``, else ``~/.cache/ais_lightning``."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "ais_lightning")
    return Path(os.environ.get("AIS_LIGHTNING_CACHE", default))


@contextlib.contextmanager
def entry_lock(root: str | os.PathLike, key: str, what: str = "cache entry") -> Iterator[None]:
    """Exclusive inter-process lock on cache entry ``key`` of ``root`` (``root/.<key>.lock``, ``fcntl``).

    A process that finds the lock taken logs that it waits for ``what`` and blocks until it is free. A
    no-op where ``fcntl`` is missing (Windows), where :func:`publish_dir` still never overwrites an entry.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s %s is being built by another process; waiting for it", what, key)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Lightning ``TorchCheckpointIO`` whose checkpoints carry a SHA-256 sidecar checked on load.

    ``save_checkpoint`` writes the checkpoint as ``TorchCheckpointIO`` does (atomically), then
    ``<path>.sha256``; ``load_checkpoint`` raises :class:`CorruptFileError` (a ``ValueError`` naming
    the path) when the hash file is missing or does not match, before ``torch.load`` sees the bytes;
    ``remove_checkpoint`` removes both. A symlinked checkpoint (``ModelCheckpoint(save_last="link")``)
    is verified through its target. Local paths only. Pass it as ``L.Trainer(plugins=[VerifiedCheckpointIO()])``.

    Args:
        allow_missing_hash: load checkpoints that have no sidecar (written before this plugin was
            used) instead of refusing them. A sidecar that exists is always checked.
    """

    def __init__(self, allow_missing_hash: bool = False) -> None:
        super().__init__()
        self.allow_missing_hash = allow_missing_hash

    @staticmethod
    def _local(path: Any) -> Path:
        text = os.fspath(path)
        if "://" in text and not text.startswith("file://"):
            raise ValueError(f"VerifiedCheckpointIO only handles local paths, got {text!r}")
        return Path(text.removeprefix("file://"))

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        local = self._local(path)
        super().save_checkpoint(checkpoint, local, storage_options=storage_options)
        write_hash(local)

    def verify(self, path: Any) -> Path:
        """Check ``path`` against its hash sidecar (through a symlink to its target); returns the local path.

        Raises ``FileNotFoundError`` when there is no checkpoint and :class:`CorruptFileError` when the
        sidecar is missing (unless ``allow_missing_hash``) or does not match.
        """
        local = self._local(path)
        target = local.resolve() if local.is_symlink() else local
        if not target.is_file():
            raise FileNotFoundError(f"Checkpoint file not found: {local}")
        if self.allow_missing_hash and not hash_path(target).exists():
            return local
        try:
            verify_file(target)
        except CorruptFileError as err:
            hint = ""
            if not hash_path(target).exists():
                hint = (
                    f"; if you trust this checkpoint, record its hash with "
                    f"`cd {target.parent} && sha256sum {target.name} > {hash_path(target).name}`"
                )
            raise CorruptFileError(local, f"refusing to load checkpoint: {err.reason}{hint}") from None
        return local

    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        local = self.verify(path)
        return super().load_checkpoint(local, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        local = self._local(path)
        super().remove_checkpoint(local)
        hash_path(local).unlink(missing_ok=True)
