"""The t-intervals of the reports (``ais_lightning.toolkit.report.intervals``) against table quantiles and hand
arithmetic."""

from __future__ import annotations

import math

import pytest

from ais_lightning.toolkit.report import mean_half_width, paired_interval, welch_interval
from ais_lightning.toolkit.report.intervals import t_quantile

T_975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 9: 2.2622}
"""97.5% quantiles of Student's t by degrees of freedom (printed tables, 4 decimals)."""


@pytest.mark.parametrize("dof", sorted(T_975))
def test_the_quantile_is_the_tables(dof):
    assert t_quantile(dof) == pytest.approx(T_975[dof], abs=1e-4)
    assert t_quantile(1e6) == pytest.approx(1.95996, abs=1e-4)  # the normal's in the limit


def test_the_interval_of_a_mean():
    # 3 seeds with std 0.1: 4.3027 x 0.1 / sqrt(3) = 0.2484, against 2 x 0.0577 = 0.115 for "2 standard errors"
    assert mean_half_width(0.1, 3) == pytest.approx(T_975[2] * 0.1 / math.sqrt(3), abs=1e-4)
    assert mean_half_width(0.1, 5) == pytest.approx(T_975[4] * 0.1 / math.sqrt(5), abs=1e-4)
    assert math.isnan(mean_half_width(0.1, 1)) and math.isnan(mean_half_width(float("nan"), 3))


def test_welch_interval_of_a_difference():
    # equal spreads and counts: se^2 = 2 x 0.02^2 / 2, Welch-Satterthwaite dof = (2 v)^2 / (2 v^2 / 1) = 2
    d, half = welch_interval((0.3, 0.02, 2), (0.1, 0.02, 2))
    assert d == pytest.approx(0.2) and half == pytest.approx(T_975[2] * 0.02, abs=1e-5)
    # one side without spread: the other's interval alone (n - 1 = 9 degrees of freedom)
    d, half = welch_interval((0.5, 0.0, 4), (0.4, 0.3, 10))
    assert d == pytest.approx(0.1) and half == pytest.approx(T_975[9] * 0.3 / math.sqrt(10), abs=1e-5)
    assert welch_interval((0.5, 0.0, 3), (0.5, 0.0, 3)) == (0.0, 0.0)
    assert math.isnan(welch_interval((0.5, 0.1, 1), (0.4, 0.1, 3))[1])


def test_paired_interval_of_differences():
    # 0.05, 0.04, 0.08: mean 0.05667, std 0.02082, 4.3027 x 0.02082 / sqrt(3) = 0.05171
    mean, half, n = paired_interval([0.05, 0.04, 0.08])
    assert (mean, n) == (pytest.approx(0.17 / 3), 3) and half == pytest.approx(0.05171, abs=1e-5)
    mean, half, n = paired_interval([0.05])
    assert n == 1 and math.isnan(mean) and math.isnan(half)
