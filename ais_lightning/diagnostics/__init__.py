"""Mismatch diagnostics as torchmetrics Metrics (one scalar each, sum-reduced states)."""

from __future__ import annotations

from ais_lightning.diagnostics.ais_coefficient import AISCoefficient
from ais_lightning.diagnostics.alignment import (
    JensenShannon,
    MismatchKLStatistic,
    ProbabilityCorrelation,
    ProbabilityDiff,
    ReverseKL,
    SequenceMultProbError,
    TokenMultProbError,
    responses_within_error,
    sequence_mult_prob_error,
)
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
from ais_lightning.diagnostics.perplexity import LogPerplexityDiff, SequencePerplexity
from ais_lightning.diagnostics.psis import PSISKHat
from ais_lightning.diagnostics.routing import RoutingDisagreement
from ais_lightning.diagnostics.weights import AbsLogRatio, ClippedRatioMoment, SequenceRatioStatistic

__all__ = [
    "AISCoefficient",
    "AbsLogRatio",
    "ChiSquare",
    "ClippedRatioMoment",
    "CorrectionFraction",
    "EffectiveSampleSize",
    "ErrorTokenRate",
    "JensenShannon",
    "LogPerplexityDiff",
    "MismatchDiagnostics",
    "MismatchKL",
    "MismatchKLStatistic",
    "PSISKHat",
    "PerplexityRatio",
    "ProbabilityCorrelation",
    "ProbabilityDiff",
    "RatioStatistic",
    "ReverseKL",
    "RoutingDisagreement",
    "SequencePerplexity",
    "SequenceMultProbError",
    "SequenceRatioStatistic",
    "TokenEntropy",
    "TokenMultProbError",
    "repeat_token_mask",
    "responses_within_error",
    "sequence_mult_prob_error",
]
