"""Faulty parts for the fault-injection tests, plugged into real ``ais-train`` runs, and a timed driver.

The parts are what a user could plug in by one YAML file on Hydra's search path (``hydra.searchpath``):

- :class:`NaNLogprobEngine`: a rollout engine whose log-probs are NaN on every sampled token;
- :class:`ExitOnSampleEngine`: a rollout engine that calls ``sys.exit(0)`` when it first samples;
- :class:`SigtermOnGreedyEngine`: a rollout engine that sends SIGTERM to its own process the first time
  it decodes greedily (a validation), the way a scheduler's stop can arrive at any moment;
- :class:`FlakyArithmetic`: the arithmetic task with a reward function that raises (always, or on every
  other call) and warns once;
- :func:`after_file_steps`: a call after every file-system step of a checkpoint write, where a kill or a signal
  can land.

``python -m tests.reliability.faults ARGS`` is ``ais-train ARGS`` with the libraries every run imports
loaded first; it prints ``RUN_SECONDS=<s>`` (the run itself, without the interpreter start and the
imports, which take tens of seconds on a busy machine) to stderr when it ends. With
``$AIS_TEST_FROZEN_NOW`` set (an ISO time), Hydra's clock (``${now:...}`` in the run directory) reads that
time, so that two real processes start "in the same second" as far as Hydra can tell, every time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ais_lightning import files
from ais_lightning.rollout.torch_engine import TorchRolloutEngine
from ais_lightning.tasks.arithmetic import Arithmetic

FROZEN_NOW = "AIS_TEST_FROZEN_NOW"
"""Environment variable: the ISO time Hydra's ``${now:...}`` reads in ``python -m tests.reliability.faults``."""
USER_WARNING = "flaky reward: a warning of the task's own"
"""The warning :class:`FlakyArithmetic` emits once (a real warning that must still reach the user)."""


class NaNLogprobEngine(TorchRolloutEngine):
    """The torch engine, except that every sampled token's log-prob is NaN (e.g. a broken low-precision
    kernel): every rollout step of a run with it has non-finite log-probs."""

    def generate(self, prompts: Any, sampling: Any) -> Any:
        batch = super().generate(prompts, sampling)
        batch.rollout_logprobs = batch.rollout_logprobs.masked_fill(batch.response_mask, float("nan"))
        return batch


class ExitOnSampleEngine(TorchRolloutEngine):
    """The torch engine, calling ``sys.exit(0)`` on its first sampled (training) ``generate``: code of the run's
    own that ends the process the way only a signal should."""

    def generate(self, prompts: Any, sampling: Any) -> Any:
        if sampling.temperature > 0:
            sys.exit(0)
        return super().generate(prompts, sampling)


class SigtermOnGreedyEngine(TorchRolloutEngine):
    """The torch engine, sending SIGTERM to this process on its first greedy ``generate`` (validation)."""

    sent = False

    def generate(self, prompts: Any, sampling: Any) -> Any:
        if sampling.temperature == 0 and not SigtermOnGreedyEngine.sent:
            SigtermOnGreedyEngine.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return super().generate(prompts, sampling)


@dataclass
class FlakyArithmetic(Arithmetic):
    """Arithmetic whose reward function raises on every call (``fail="always"``) or on every other call,
    the first included (``fail="every_other"``); it warns once (:data:`USER_WARNING`)."""

    fail: str = "always"
    """always | every_other."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fail not in ("always", "every_other"):
            raise ValueError(f"fail must be 'always' or 'every_other', got {self.fail!r}")
        self._calls = 0

    def reward(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        self._calls += 1
        if self._calls == 1:
            warnings.warn(USER_WARNING, UserWarning, stacklevel=2)
        if self.fail == "always" or self._calls % 2 == 1:
            raise RuntimeError(f"flaky reward failed on call {self._calls}")
        return super().reward(prompts, completions, **fields)


@contextlib.contextmanager
def after_file_steps(step: Callable[[], None]) -> Iterator[None]:
    """Call ``step()`` right after every file-system step of :mod:`ais_lightning.files` (the checkpoint writes):
    a file created for writing, its first bytes written (flushed), a rename, a removal. Undone after the block."""

    class SteppedFile:
        def __init__(self, handle: Any) -> None:
            self._handle, self._written = handle, False

        def write(self, data: Any) -> int:
            n = self._handle.write(data)
            if not self._written:
                self._written = True
                self._handle.flush()
                step()
            return n

        def __getattr__(self, name: str) -> Any:
            return getattr(self._handle, name)

        def __enter__(self) -> SteppedFile:
            return self

        def __exit__(self, *exc: Any) -> None:
            self._handle.close()

    def stepped_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = open(path, mode, *args, **kwargs)
        if "x" in mode or "w" in mode:
            step()
            return SteppedFile(handle)
        return handle

    class SteppedOs:
        def __getattr__(self, name: str) -> Any:
            attr = getattr(os, name)
            if name not in ("replace", "rename", "unlink", "remove"):
                return attr

            def stepped(*args: Any, **kwargs: Any) -> Any:
                result = attr(*args, **kwargs)
                step()
                return result

            return stepped

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(files, "os", SteppedOs())
        patch.setattr(files, "open", stepped_open, raising=False)
        yield


def _freeze_hydra_clock(iso: str) -> None:
    """Hydra's ``${now:...}`` reads ``iso`` (e.g. ``2026-01-02T03:04:05``) instead of the wall clock."""
    import datetime

    import hydra.core.utils

    frozen = datetime.datetime.fromisoformat(iso)

    class FrozenClock(datetime.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> datetime.datetime:
            return frozen

    hydra.core.utils.datetime = FrozenClock


def _timed_main() -> None:
    import lightning  # noqa: F401 - every run imports these; loaded before the clock starts
    import mlflow  # noqa: F401

    from ais_lightning.app import train

    if os.environ.get(FROZEN_NOW):
        _freeze_hydra_clock(os.environ[FROZEN_NOW])
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        train.main()
    finally:
        print(f"RUN_SECONDS={time.perf_counter() - started:.3f}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    _timed_main()
