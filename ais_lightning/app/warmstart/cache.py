"""The warm start's cache entries: ``<cache_dir>/<key>/`` with the weights and their metadata, verified.

An entry holds ``policy.pt`` and ``meta.json``, each with a SHA-256 sidecar (:mod:`ais_lightning.files`),
built under a temporary name and published by one atomic rename; a corrupt or incomplete one is named in a
warning, discarded and rebuilt. (The lock that makes concurrent runs build an entry once is
:func:`ais_lightning.files.entry_lock`, taken by :func:`ais_lightning.app.warmstart.warm_start`.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ais_lightning.files import (
    CorruptFileError,
    cache_root,
    discard_dir,
    load_verified,
    make_temp_dir,
    publish_dir,
    read_text_verified,
    save_verified,
    write_text_verified,
)
from ais_lightning.policy import Policy

__all__ = ["META_FILE", "WEIGHTS_FILE", "default_cache_dir", "read_entry", "write_entry"]

log = logging.getLogger(__name__)

WEIGHTS_FILE = "policy.pt"
META_FILE = "meta.json"


def default_cache_dir() -> Path:
    """``$AIS_LIGHTNING_CACHE/warmstart``, else ``~/.cache/ais_lightning/warmstart``."""
    return cache_root() / "warmstart"


def read_entry(entry: Path, key: str, policy: Policy) -> dict[str, Any] | None:
    """The metadata of a valid entry after loading its weights into ``policy``; None if absent.

    A corrupt or incomplete entry is named in a warning and discarded (the caller rebuilds it).
    """
    if not entry.exists():
        return None
    try:
        meta = json.loads(read_text_verified(entry / META_FILE))
        if not isinstance(meta, dict) or meta.get("key") != key:
            raise CorruptFileError(entry / META_FILE, f"does not describe cache key {key}")
        for name in ("accuracy", "steps", "steps_trained", "backoffs", "lr", "eval_size"):
            if not isinstance(meta.get(name), (int, float)):
                raise CorruptFileError(entry / META_FILE, f"has no number {name!r}")
        state = load_verified(entry / WEIGHTS_FILE)
        expected = policy.model.state_dict()
        if not isinstance(state, dict) or set(state) != set(expected):
            raise CorruptFileError(entry / WEIGHTS_FILE, "does not hold this model's state dict")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(expected[name].shape) or tensor.dtype != expected[name].dtype:
                raise CorruptFileError(entry / WEIGHTS_FILE, f"tensor {name!r} has the wrong shape or dtype")
    except (CorruptFileError, ValueError, RuntimeError, OSError, EOFError) as err:
        log.warning(
            "warm-start cache entry %s is corrupt or incomplete (%s); discarding and rebuilding it",
            entry,
            err,
        )
        discard_dir(entry)
        return None
    policy.model.load_state_dict(state)
    return meta


def write_entry(root: Path, key: str, policy: Policy, meta: dict[str, Any]) -> Path:
    """Write the entry under a temporary name and publish it as ``root/key`` (atomic rename)."""
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key
    tmp = make_temp_dir(root, key)
    try:
        save_verified(policy.model.state_dict(), tmp / WEIGHTS_FILE)
        write_text_verified(tmp / META_FILE, json.dumps(meta, indent=2, sort_keys=True, default=str))
        publish_dir(tmp, entry)
    except BaseException:
        discard_dir(tmp)
        raise
    return entry
