"""Mismatch diagnostics as torchmetrics Metrics (one scalar each, sum-reduced states)."""

from __future__ import annotations

from ais_lightning.diagnostics.ais_coefficient import AISCoefficient
from ais_lightning.diagnostics.collection import MismatchDiagnostics
from ais_lightning.diagnostics.correction import CorrectionFraction
from ais_lightning.diagnostics.entropy import TokenEntropy
from ais_lightning.diagnostics.error_tokens import ErrorTokenRate, repeat_token_mask
from ais_lightning.diagnostics.mismatch import (
    ChiSquare,
    EffectiveSampleSize,
    MismatchKL,
    PerplexityRatio,
    RatioStatistic,
)

__all__ = [
    "AISCoefficient",
    "ChiSquare",
    "CorrectionFraction",
    "EffectiveSampleSize",
    "ErrorTokenRate",
    "MismatchDiagnostics",
    "MismatchKL",
    "PerplexityRatio",
    "RatioStatistic",
    "TokenEntropy",
    "repeat_token_mask",
]
