"""Student's t-intervals for means and differences of means over a few seeds (``scipy.stats.t``).

A sweep has 3 to 5 seeds per configuration. At such counts a mean ± two standard errors is no 95% interval (it
covers the true mean 82% of the time at 3 seeds, 88% at 5: the 97.5% quantile of t is 12.71 at 2 seeds, 4.30 at 3,
2.78 at 5, against 1.96 for the normal), so the reports give the half-width of the 95% t-interval, with the count it
rests on:

- a mean of n values with sample std s: ``t(n - 1) * s / sqrt(n)``;
- the difference of two means (different seeds): Welch's interval, ``t(dof) * sqrt(s_a^2/n_a + s_b^2/n_b)`` with the
  Welch-Satterthwaite degrees of freedom;
- a difference paired by seed: the interval of the mean of the n per-seed differences, ``t(n - 1) * s_d / sqrt(n)``.

Each is nan when a side has fewer than 2 values (no spread to measure).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

CONFIDENCE = 0.95
"""The level of every interval the reports give."""


def t_quantile(dof: float, confidence: float = CONFIDENCE) -> float:
    """The two-sided quantile of Student's t with ``dof`` degrees of freedom: ``t.ppf((1 + confidence) / 2, dof)``."""
    from scipy.stats import t

    return float(t.ppf((1.0 + confidence) / 2.0, dof))


def mean_half_width(std: float, n: int, confidence: float = CONFIDENCE) -> float:
    """Half-width of the t-interval of a mean of ``n`` values whose sample std (ddof=1) is ``std``; nan for n < 2."""
    if n < 2 or not math.isfinite(std):
        return float("nan")
    return t_quantile(n - 1, confidence) * std / math.sqrt(n)


def welch_interval(
    a: tuple[float, float, int], b: tuple[float, float, int], confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """``(mean_a - mean_b, half-width)`` of Welch's t-interval from ``(mean, std, n)`` of each side (different seeds);
    the half-width is nan when a side has fewer than 2 values, 0 when neither side varies."""
    (ma, sa, na), (mb, sb, nb) = a, b
    if na < 2 or nb < 2 or not (math.isfinite(sa) and math.isfinite(sb)):
        return ma - mb, float("nan")
    va, vb = sa**2 / na, sb**2 / nb  # squared standard errors of the two means
    if va + vb == 0:
        return ma - mb, 0.0
    dof = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1))  # Welch-Satterthwaite
    return ma - mb, t_quantile(dof, confidence) * math.sqrt(va + vb)


def paired_interval(diffs: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, int]:
    """``(mean, half-width, n)`` of the t-interval of the mean of ``n`` per-seed differences; (nan, nan, n) for
    n < 2."""
    n = len(diffs)
    if n < 2:
        return float("nan"), float("nan"), n
    return statistics.fmean(diffs), mean_half_width(statistics.stdev(diffs), n, confidence), n
