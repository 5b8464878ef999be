"""SIGTERM for the whole of a run, not only inside ``Trainer.fit``.

Lightning handles SIGTERM while a ``Trainer`` entry point runs: its handler sets a flag that the loops
check between batches. Two gaps remain in a run that validates before it trains (``ais-train``):

- the flag is reset when the next entry point starts, so a SIGTERM during the last batch of
  ``trainer.validate()`` (which the evaluation loop does not check) is forgotten and ``fit`` trains on;
- between two entry points Lightning's handler is gone, and the default action kills the process with
  the MLflow run left RUNNING or already FINISHED.

:class:`SigtermGuard` closes both: while :meth:`SigtermGuard.installed` is active its own handler records
the signal (Lightning composes it with its handler during ``validate``/``fit``), the run checks it at
its boundaries (:meth:`SigtermGuard.raise_if_received`), and as a callback it raises at the start of
training, after Lightning has reset its flag. The stop is Lightning's :class:`SIGTERMException`, so one
``except`` handles both.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ais_lightning.correctors.distributed import all_reduce_sum, is_distributed


def any_rank(flag: bool) -> bool:
    """``flag`` OR-ed over the ranks of the default process group (itself without one).

    Every rank must call it at the same point, as for any collective: one rank that stops alone would
    leave the others waiting in the next collective.
    """
    nccl = is_distributed() and dist.get_backend() == "nccl"  # NCCL reduces CUDA tensors only
    vote = torch.tensor(
        [float(flag)], device=torch.device("cuda", torch.cuda.current_device()) if nccl else None
    )
    return bool(all_reduce_sum(vote).item() > 0)


class SigtermGuard(Callback):
    """Remembers a SIGTERM from :meth:`installed` on; raises :class:`SIGTERMException` where it is checked."""

    def __init__(self) -> None:
        self.received = False

    def _record(self, signum: int, frame: Any) -> None:
        self.received = True

    @contextmanager
    def installed(self) -> Iterator[SigtermGuard]:
        """Record SIGTERM instead of dying of it, until the block ends (then the previous handler is back).

        Signal handlers can only be set from the main thread; elsewhere (a launcher's worker thread) this
        does nothing and the process keeps its own handling.
        """
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGTERM, self._record)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)

    def raise_if_received(self) -> None:
        """Between entry points: stop every rank if any rank received SIGTERM."""
        if any_rank(self.received):
            raise SIGTERMException

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # fit() has just reset Lightning's own flag; a SIGTERM recorded before that must still stop the run
        self.raise_if_received()
