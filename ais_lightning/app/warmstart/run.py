"""The warm start as a run uses it: the cache key, the lock, a cache hit or the band search at a fixed thread
count, and the entry written; :class:`WarmStartResult` says what happened."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ais_lightning.app.warmstart.cache import default_cache_dir, read_entry, write_entry
from ais_lightning.app.warmstart.key import cache_key, cache_key_payload
from ais_lightning.app.warmstart.search import train_warm_start
from ais_lightning.app.warmstart.settings import WarmStartSettings
from ais_lightning.app.warmstart.threads import intra_op_threads
from ais_lightning.files import entry_lock
from ais_lightning.policy import Policy
from ais_lightning.tasks import Task

__all__ = ["WarmStartResult", "warm_start"]


@dataclass
class WarmStartResult:
    """What :func:`warm_start` did; ``policy`` holds the warm-started weights."""

    path: Path
    """The cache entry directory (``policy.pt``, ``meta.json``)."""
    from_cache: bool
    """Loaded from an existing entry (True) or trained now (False)."""
    accuracy: float
    """Greedy accuracy of the returned weights on the held-out prompts (measured when they were built)."""
    eval_size: int
    """Number of held-out prompts ``accuracy`` was measured on."""
    steps: int
    """Optimizer steps behind the returned weights."""
    steps_trained: int
    """Optimizer steps trained in all, including those undone by back-offs."""
    backoffs: int
    """Times a segment jumped over the band and was retried with a smaller lr."""
    lr: float
    """Learning rate of the segment that produced the weights (``settings.lr`` times the back-offs)."""
    key: str
    """The cache key."""
    build_time_s: float
    """Wall time of the build (of the original build for a cache hit)."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Every evaluation: ``{"step", "steps_trained", "accuracy", "lr"}``."""

    def describe(self) -> str:
        """One line for logs and summaries."""
        how = "loaded from" if self.from_cache else "trained, cached in"
        backoffs = f", {self.backoffs} back-off(s)" if self.backoffs else ""
        return (
            f"greedy accuracy {self.accuracy:.3f} on {self.eval_size} held-out prompts after {self.steps} SFT "
            f"steps{backoffs}; {how} {self.path}"
        )


def warm_start(
    policy: Policy,
    tokenizer: Any,
    task: Task,
    settings: WarmStartSettings,
    *,
    seed: int,
    progress_bar: bool = True,
) -> WarmStartResult:
    """Warm-start ``policy`` in place on ``task`` (SFT to the target band), or load the cached result.

    Args:
        policy: the policy to train; its current weights are the starting point (and part of the key).
        tokenizer: the policy's tokenizer (None: ``policy.tokenizer``).
        task: an ``ais_lightning.tasks.Task`` dataclass instance (its reference solutions are the SFT data).
        settings: every warm-start setting (see :class:`WarmStartSettings`).
        seed: the run's seed; the SFT uses ``settings.seed`` when that is set.
        progress_bar: show a progress bar while training.

    Returns:
        A :class:`WarmStartResult` (cache path, whether it was a cache hit, the measured accuracy...).

    Raises:
        WarmStartError: the target band was not reached (the policy is then left partly trained).
    """
    if not isinstance(settings, WarmStartSettings):
        raise ValueError(f"settings must be a WarmStartSettings, got {type(settings).__name__}")
    if tokenizer is None:
        tokenizer = policy.tokenizer
        if tokenizer is None:
            raise ValueError("warm_start needs a tokenizer (none given and policy.tokenizer is None)")
    sft_seed = seed if settings.seed is None else settings.seed
    threads = settings.num_threads or torch.get_num_threads()
    payload = cache_key_payload(policy, tokenizer, task, settings, sft_seed, threads)
    key = cache_key(payload)
    root = Path(settings.cache_dir) if settings.cache_dir else default_cache_dir()
    _check_cache_writable(root, settings.cache_dir)
    with entry_lock(root, key, "warm start"):
        meta = read_entry(root / key, key, policy)
        if meta is not None:
            return _result(root / key, True, meta)
        started = time.perf_counter()
        with intra_op_threads(threads):
            out = train_warm_start(policy, tokenizer, task, settings, sft_seed, progress_bar)
        meta = {
            "key": key,
            **out,
            "eval_size": settings.eval_size,
            "build_time_s": time.perf_counter() - started,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "payload": payload,
        }
        entry = write_entry(root, key, policy, meta)
    return _result(entry, False, meta)


def _result(entry: Path, from_cache: bool, meta: dict[str, Any]) -> WarmStartResult:
    return WarmStartResult(
        path=entry,
        from_cache=from_cache,
        accuracy=float(meta["accuracy"]),
        eval_size=int(meta["eval_size"]),
        steps=int(meta["steps"]),
        steps_trained=int(meta["steps_trained"]),
        backoffs=int(meta["backoffs"]),
        lr=float(meta["lr"]),
        key=str(meta["key"]),
        build_time_s=float(meta.get("build_time_s", float("nan"))),
        history=list(meta.get("history", [])),
    )


def _check_cache_writable(root: Path, configured: str | None) -> None:
    """ValueError naming the key and the way out unless the warm-start cache ``root`` can be created and written
    (a read-only home used to end in a bare ``mkdir`` traceback)."""
    from ais_lightning.app.tracking import check_writable

    key = (
        "warmstart.cache_dir"
        if configured
        else "warmstart.cache_dir (unset: $AIS_LIGHTNING_CACHE, else ~/.cache)"
    )
    try:
        check_writable(root, key)
    except ValueError as err:
        raise ValueError(
            f"{err}: set warmstart.cache_dir or $AIS_LIGHTNING_CACHE to a writable directory, or warmstart=disabled"
        ) from err
