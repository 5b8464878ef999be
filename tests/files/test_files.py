"""Verified files: atomic writes, SHA-256 sidecars, refusal of corrupt or incomplete files."""

import hashlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from ais_lightning.files import (
    CorruptFileError,
    VerifiedCheckpointIO,
    atomic_write,
    discard_dir,
    hash_path,
    load_verified,
    make_temp_dir,
    publish_dir,
    read_hash,
    read_text_verified,
    save_verified,
    verify_file,
    write_hash,
    write_text_verified,
)


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def test_sidecar_is_sha256sum_format_of_the_bytes(tmp_path):
    path = tmp_path / "a.bin"
    digest = write_text_verified(path, "hello\n")
    assert digest == hashlib.sha256(b"hello\n").hexdigest()
    assert hash_path(path) == tmp_path / "a.bin.sha256"
    assert hash_path(path).read_text() == f"{digest}  a.bin\n"
    if shutil.which("sha256sum"):  # the sidecar checks with coreutils too
        subprocess.run(["sha256sum", "--check", "--status", "a.bin.sha256"], cwd=tmp_path, check=True)


def test_torch_roundtrip_and_no_temporary_files_left(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2])}
    path = tmp_path / "sub" / "state.pt"
    save_verified(state, path)
    loaded = load_verified(path)
    assert (
        set(loaded) == {"w", "b"}
        and torch.equal(loaded["w"], state["w"])
        and torch.equal(loaded["b"], state["b"])
    )
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.pt", "state.pt.sha256"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "append"])
def test_damaged_file_is_refused_naming_it(tmp_path, damage):
    path = tmp_path / "state.pt"
    save_verified({"w": torch.randn(64)}, path)
    if damage == "flip":
        flip_byte(path)
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    else:
        path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(CorruptFileError, match="does not match") as info:
        load_verified(path)
    assert isinstance(info.value, ValueError) and str(path) in str(info.value) and info.value.path == path


def test_missing_or_malformed_sidecar_and_missing_file(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("data")
    with pytest.raises(CorruptFileError, match=r"no hash file x\.txt\.sha256"):
        verify_file(path)
    hash_path(path).write_text("not a hash\n")
    with pytest.raises(CorruptFileError, match="malformed"):
        read_text_verified(path)
    write_hash(path)
    assert read_text_verified(path) == "data"
    assert read_hash(path) == hashlib.sha256(b"data").hexdigest()
    path.unlink()
    with pytest.raises(CorruptFileError, match="file is missing"):
        verify_file(path)


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    write_text_verified(path, "old")

    def boom(f):
        f.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, boom)
    assert read_text_verified(path) == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt", "f.txt.sha256"]


def test_publish_dir_never_overwrites_and_discard_dir(tmp_path):
    first, second = make_temp_dir(tmp_path, "k"), make_temp_dir(tmp_path, "k")
    assert first != second and first.name.startswith(".k-")
    (first / "who").write_text("first")
    (second / "who").write_text("second")
    final = tmp_path / "k"
    assert publish_dir(first, final) is True
    assert publish_dir(second, final) is False  # another process published first: ours is dropped
    assert (final / "who").read_text() == "first" and not second.exists() and not first.exists()
    discard_dir(final)
    assert list(tmp_path.iterdir()) == []
    discard_dir(final)  # already gone: no error


def test_temp_dir_mode_follows_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = make_temp_dir(tmp_path, "m")
        write_text_verified(path / "f", "x")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o755
    assert (path / "f").stat().st_mode & 0o777 == 0o644


class _CtrlCWhenSaved:
    """Pickles as 7, pressing Ctrl+C (SIGINT to this process) in the middle of ``torch.save``."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGINT)
        return (int, (7,))


def test_ctrl_c_during_a_checkpoint_save_waits_for_the_file_then_interrupts(tmp_path):
    path = tmp_path / "last.ckpt"
    checkpoint = {"before": torch.arange(1000.0), "press": _CtrlCWhenSaved(), "after": torch.ones(50_000)}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(
        KeyboardInterrupt
    ):  # delivered, but only once the checkpoint and its hash are published
        VerifiedCheckpointIO().save_checkpoint(checkpoint, path)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the run's handler is back
    loaded = VerifiedCheckpointIO().load_checkpoint(path, weights_only=False)
    assert loaded["press"] == 7 and torch.equal(loaded["after"], torch.ones(50_000))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]


def test_a_second_ctrl_c_interrupts_the_write_at_once_and_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "state.bin"
    atomic_write(path, lambda f: f.write(b"old"))
    written = []

    def press_twice(f):
        f.write(b"new, ")
        os.kill(os.getpid(), signal.SIGINT)
        f.write(b"still writing, ")  # the first press waits for the end of the write
        os.kill(os.getpid(), signal.SIGINT)
        written.append("past the second press")

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, press_twice)
    assert written == [] and path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.bin"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
