"""Third-party messages that say nothing about an ``ais-train`` run, silenced one by one at their source.

Each filter matches one known message exactly and says why it does not apply; every other warning
still prints. Called by ``ais-train`` (and the warm start) before Lightning starts.
"""

from __future__ import annotations

import logging
import warnings

KNOWN_WARNINGS = (
    # torch >= 2.10 deprecates constructing ``LeafSpec()``; Lightning 2.6's ``utilities/_pytree.py`` still
    # does it on every batch transfer. Nothing for a user to change; Lightning will follow torch.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # ModelCheckpoint under manual optimization suggests saving the weights from *before* the optimizer
    # step. GRPOModule checkpoints after its optimizer steps on purpose: the weights, the optimizer state and
    # the data position then belong to the same step, which is what resuming needs.
    r"Using ModelCheckpoint with manual optimization and every_n_train_steps",
)

KNOWN_INFO = (
    # Lightning advertises its cloud logger whenever another logger is used.
    "try installing [litlogger]",
)


class _DropKnownInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in KNOWN_INFO)


_FILTER = _DropKnownInfo()


QUIET_LOGGERS = (
    # MLflow announces creating and migrating its SQLite store's tables on the first run of a store.
    "mlflow.store.db.utils",
    "alembic.runtime.migration",
)
"""Loggers whose INFO lines are the tracking store's housekeeping; their warnings still print."""


def silence_known_noise() -> None:
    """Install the filters above (idempotent)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
