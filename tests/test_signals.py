"""``SigtermGuard``: a SIGTERM is remembered across Lightning's entry points and stops the run where checked."""

from __future__ import annotations

import os
import signal
import tempfile
import threading

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset

from ais_lightning.app.signals import SigtermGuard, any_rank
from tests.gloo import free_port, gloo_group


def test_a_sigterm_inside_the_block_is_recorded_and_the_previous_handler_comes_back():
    guard = SigtermGuard()
    before = signal.getsignal(signal.SIGTERM)
    with guard.installed():
        guard.raise_if_received()  # nothing received yet: no stop
        os.kill(os.getpid(), signal.SIGTERM)  # the default action would end this process
        assert guard.received
        with pytest.raises(SIGTERMException):
            guard.raise_if_received()
    assert signal.getsignal(signal.SIGTERM) is before


def test_outside_the_main_thread_the_guard_leaves_the_handler_alone():
    guard, seen = SigtermGuard(), []

    def worker() -> None:
        with guard.installed():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [before]


class _SigtermInLastValidationBatch(L.LightningModule):
    """One validation batch that sends SIGTERM to this process; counts its training steps."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.trained_steps = 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.trained_steps += 1
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        self.log("val/loss", self.layer(batch[0]).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_sigterm_in_validates_last_batch_stops_the_fit_that_follows():
    """Lightning alone forgets it (the evaluation loop does not check its last batch, and ``fit`` resets
    the flag); with the guard as callback ``fit`` stops before its first step."""
    loader = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=4)
    guard, module = SigtermGuard(), _SigtermInLastValidationBatch()
    with tempfile.TemporaryDirectory() as root, guard.installed():
        trainer = L.Trainer(
            max_steps=3,
            logger=False,
            callbacks=[guard],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.validate(module, dataloaders=loader, verbose=False)  # returns: Lightning did not stop
        assert guard.received, "Lightning composed the guard's handler with its own"
        with pytest.raises(SIGTERMException):
            trainer.fit(module, train_dataloaders=loader)
    assert module.trained_steps == 0


def _vote(rank: int, port: int, results: dict) -> None:
    with gloo_group(rank, 2, port):
        results[rank] = (any_rank(rank == 0), any_rank(False))


def test_any_rank_is_an_or_over_the_process_group():
    assert any_rank(True) and not any_rank(False)  # no process group: the flag itself
    with torch.multiprocessing.Manager() as manager:
        results = manager.dict()
        torch.multiprocessing.spawn(_vote, args=(free_port(), results), nprocs=2)
        assert dict(results) == {0: (True, False), 1: (True, False)}
