"""Verified files: written atomically, published with a SHA-256 sidecar, checked on every load.

A file ``X`` we write is first written under a temporary name in its own directory, flushed to disk
and renamed onto ``X`` (``os.replace`` is atomic on POSIX and Windows), so a reader never sees half a
file. Its SHA-256 lives in ``X.sha256`` in ``sha256sum`` format (``<hex>  <name>``), and
:func:`publish_verified` publishes the two so that a crash at any instant never leaves a stale pair:
the new file's hash is added to the sidecar *beside* the current file's before the file is renamed into
place, and the old hash is dropped after. At every instant ``X`` therefore matches a hash its sidecar
lists (or, for a file that was never verified, has no sidecar: incomplete, never trusted). Loading
recomputes the hash and raises :class:`CorruptFileError` (a ``ValueError``) naming the file when the
sidecar is missing, malformed or lists no hash of the content, so flipped bytes or a truncated file are
never loaded silently. A write that fails because the disk is full raises :class:`DiskFullError` naming
the file and leaves neither a temporary file nor an unverified one behind.

A directory of such files (e.g. a warm-start cache entry) is built under a temporary name and
published by one atomic rename (:func:`publish_dir`); :func:`discard_dir` moves a bad one out of the
way before deleting it, so no other process ever sees it half deleted under its real name. Caches of
such entries live under :func:`cache_root`, and :func:`entry_lock` makes concurrent processes build
one entry once (the others wait, then read it).

:class:`VerifiedCheckpointIO` brings the same guarantee to Lightning checkpoints: a
``TorchCheckpointIO`` (``lightning/fabric/plugins/io/torch_io.py``) whose saves go through
:func:`publish_verified` (``last.ckpt`` is overwritten at every save: a kill between the file and its hash
used to leave the new file beside the old hash), that verifies before each load and removes the sidecar
with the checkpoint. Strategies that do not go through ``CheckpointIO`` (Lightning's
``ModelParallelStrategy``/FSDP2 with distributed checkpoints, which write a directory) are not covered.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import signal
import threading
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


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""``errno`` values of a write that failed for want of space (no space left, disk quota exceeded)."""


class DiskFullError(OSError):
    """A write failed because the file system is full; ``filename`` is the file that could not be written."""


def find_cause(err: BaseException | None, test: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception of ``err``'s chain (itself, then its cause or context, ...) that passes ``test``."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if test(err):
            return err
        err = err.__cause__ or err.__context__
    return None


def disk_full(err: BaseException) -> OSError | None:
    """The disk-full ``OSError`` behind ``err`` (itself, its cause or its context), else None."""
    return find_cause(err, lambda e: isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS)  # type: ignore[return-value]


@contextlib.contextmanager
def naming_disk_full(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Re-raise a disk-full ``OSError`` inside the block as :class:`DiskFullError` naming ``path`` (``what``
    it is, e.g. "checkpoint"); other errors pass unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as err:
        if err.errno not in DISK_FULL_ERRNOS:
            raise
        raise DiskFullError(
            err.errno, f"{os.strerror(err.errno)}: could not write the {what}", str(path)
        ) from err


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


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl+C (SIGINT) until the block ends, then deliver it: a write is never cut in the middle.

    A ``KeyboardInterrupt`` raised inside a writer does not always come out as one: ``torch.save``'s zip writer
    closes the archive on its way out, fails on the half-written record and raises a ``RuntimeError`` in its
    place, so a run stopped by Ctrl+C during a checkpoint save ended as a crash (exit 1, not 130). Inside the
    block a first SIGINT is only recorded; when the block ends the handler that was in place is called with it
    (Python's default one raises ``KeyboardInterrupt`` there, at a point where the file is whole or absent). A second
    Ctrl+C inside the block interrupts at once (a write that hangs, e.g. on a stalled network disk, can still be
    stopped; the file is then left as it was). Only the main thread can set handlers: elsewhere, or when SIGINT's
    handler is not a Python function, this does nothing.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    received: list[int] = []

    def record(signum: int, frame: Any) -> None:
        if received:  # pressed again: the user will not wait for the write (delivered once, now)
            received.clear()
            previous(signum, frame)
        else:
            received.append(signum)

    signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            previous(signal.SIGINT, None)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it onto ``path``.

    The temporary file is removed if ``write`` raises; ``path`` is then untouched. A Ctrl+C waits for the end
    of the write (:func:`ctrl_c_deferred`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # open() honours the umask
    with ctrl_c_deferred():
        try:
            _write_synced(tmp, write)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    _fsync_dir(path.parent)


def _write_synced(tmp: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """``write(f)`` into the new file ``tmp``, flushed and fsynced."""
    with open(tmp, "xb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _write_sidecar(path: Path, digests: list[str]) -> None:
    """Write ``path``'s sidecar atomically, one ``<hex>  <name>`` line per digest (duplicates dropped)."""
    lines = "".join(f"{d}  {path.name}\n" for d in dict.fromkeys(digests))
    atomic_write(hash_path(path), lambda f: f.write(lines.encode()))


def write_hash(path: str | os.PathLike) -> str:
    """Hash the file at ``path`` as it is on disk and write the sidecar atomically; returns the hex."""
    path = Path(path)
    digest = sha256_file(path)
    _write_sidecar(path, [digest])
    return digest


def read_hashes(path: str | os.PathLike) -> list[str]:
    """Every hex SHA-256 the sidecar of ``path`` lists (one, or two while :func:`publish_verified` replaces the
    file); CorruptFileError if the sidecar is missing, empty or malformed."""
    sidecar = hash_path(path)
    try:
        text = sidecar.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        raise CorruptFileError(path, f"no hash file {sidecar.name} beside it (incomplete write?)") from None
    digests = []
    for line in text.lower().splitlines() or [""]:
        match = _SIDECAR_RE.match(line.strip())
        if match is None:
            raise CorruptFileError(path, f"hash file {sidecar.name} is malformed: {text[:80]!r}")
        digests.append(match.group(1))
    return digests


def read_hash(path: str | os.PathLike) -> str:
    """The hex SHA-256 recorded for ``path`` (the newest, listed first); CorruptFileError if the sidecar is
    missing or malformed."""
    return read_hashes(path)[0]


def verify_file(path: str | os.PathLike) -> str:
    """Check ``path`` against its sidecar; returns the hex, or raises CorruptFileError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CorruptFileError(path, "file is missing")
    expected = read_hashes(path)
    actual = sha256_file(path)
    if actual not in expected:
        raise CorruptFileError(
            path,
            f"content hash {actual[:16]}... does not match {hash_path(path).name} ({expected[0][:16]}...): "
            "the file was damaged or modified after it was written, or its write was interrupted",
        )
    return actual


def publish_verified(path: str | os.PathLike, write: Callable[[IO[bytes]], Any], what: str = "file") -> str:
    """Write ``path`` and its sidecar so that no crash leaves a stale pair; returns the hex SHA-256.

    ``write(f)`` fills a temporary file beside ``path`` (flushed and fsynced), which is hashed. Then:

    1. the sidecar is rewritten atomically to list the new hash *and* the hashes it listed (so the file
       still at ``path`` keeps verifying); a ``path`` that exists without a valid sidecar (never verified)
       instead loses any sidecar it has, and stays unverified;
    2. the temporary file is renamed onto ``path`` (it matches the new hash, listed in step 1);
    3. the sidecar is rewritten to list the new hash alone.

    A crash at any moment leaves ``path`` either absent, or matching a hash its sidecar lists, or (only for a
    file that was never verified) without a sidecar; a leftover temporary file has a hidden name
    (``.<name>.<random>.tmp``) that no ``*.ckpt`` glob matches. On an error (e.g. a full disk) the temporary
    file is removed, a sidecar written for a file that never appeared is removed too, and a disk-full
    ``OSError`` is raised as :class:`DiskFullError` naming ``path`` (``what`` it is). A Ctrl+C waits for the end
    of the whole publication (:func:`ctrl_c_deferred`).
    """
    path = Path(path)
    with ctrl_c_deferred(), naming_disk_full(path, what):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
        fresh_sidecar = False
        try:
            _write_synced(tmp, write)
            digest = sha256_file(tmp)
            if os.path.lexists(path):
                try:
                    listed = read_hashes(path)
                except CorruptFileError:  # never verified: it must not become verified by accident
                    listed = None
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(hash_path(path))
                if listed is not None and listed != [digest]:
                    _write_sidecar(path, [digest, *listed])
            else:
                _write_sidecar(path, [digest])
                fresh_sidecar = True
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if fresh_sidecar and not os.path.lexists(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(hash_path(path))
            raise
        _fsync_dir(path.parent)
        _write_sidecar(path, [digest])  # a failure here leaves path verified by the two-hash sidecar
    return digest


def save_verified(obj: Any, path: str | os.PathLike) -> str:
    """``torch.save(obj)`` to ``path`` and its sidecar (:func:`publish_verified`); returns the hex SHA-256."""
    return publish_verified(path, lambda f: torch.save(obj, f))


def load_verified(path: str | os.PathLike, **torch_load_kwargs: Any) -> Any:
    """Verify ``path`` against its sidecar, then ``torch.load`` it (``weights_only=True`` unless given).

    Raises CorruptFileError before unpickling anything that does not match its hash.
    """
    verify_file(path)
    torch_load_kwargs.setdefault("weights_only", True)
    torch_load_kwargs.setdefault("map_location", "cpu")
    return torch.load(path, **torch_load_kwargs)


def write_text_verified(path: str | os.PathLike, text: str) -> str:
    """Write UTF-8 ``text`` and its sidecar (:func:`publish_verified`); returns the hex SHA-256."""
    return publish_verified(path, lambda f: f.write(text.encode("utf-8")))


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
    """Exclusive inter-process lock on cache entry ``key`` of ``root`` (``root/.<key>.lock``, ``filelock``).

    A process that finds the lock taken logs that it waits for ``what`` and blocks until it is free.
    """
    from filelock import FileLock, Timeout

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(root / f".{key}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("%s %s is being built by another process; waiting for it", what, key)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Lightning ``TorchCheckpointIO`` whose checkpoints carry a SHA-256 sidecar checked on load.

    ``save_checkpoint`` writes the checkpoint with ``torch.save`` and publishes it with ``<path>.sha256``
    (:func:`publish_verified`: a kill at any moment leaves the file matching its sidecar, a full disk a
    :class:`DiskFullError` naming the file and nothing unverified); ``load_checkpoint`` raises
    :class:`CorruptFileError` (a ``ValueError`` naming the path) when the hash file is missing or does not
    match, before ``torch.load`` sees the bytes;
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
        if storage_options is not None:  # as TorchCheckpointIO
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}"
            )
        local = self._local(path)
        publish_verified(local, lambda f: torch.save(checkpoint, f), what="checkpoint")

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
