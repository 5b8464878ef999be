"""Versions and staleness bookkeeping: hand-computed staleness statistics, the generating version under the bound
with ``wait`` and ``drop``, the deterministic lag schedule, weight snapshots and the adaptive bound."""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.staleness import (
    AdaptiveStalenessBound,
    WeightSnapshots,
    check_lag,
    generating_version,
    lag_at,
    staleness_stats,
)


def test_staleness_stats_by_hand():
    stats = staleness_stats(torch.tensor([0, 2, 2, 1, 0, 2]), bound=2, dropped=3)
    assert stats["staleness/mean"] == pytest.approx(7 / 6)
    assert stats["staleness/max"] == 2.0 and stats["staleness/dropped"] == 3.0
    assert [stats[f"staleness/frac_{k}"] for k in range(3)] == [2 / 6, 1 / 6, 3 / 6]
    assert staleness_stats(torch.zeros(0, dtype=torch.long), bound=1) == {
        "staleness/mean": 0.0,
        "staleness/max": 0.0,
        "staleness/dropped": 0.0,
        "staleness/frac_0": 0.0,
        "staleness/frac_1": 0.0,
    }


@pytest.mark.parametrize(
    ("current", "lag", "bound", "on_stale", "expected"),
    [
        (10, 2, 2, "wait", (8, False)),  # within the bound: exactly lag versions old
        (10, 0, 2, "drop", (10, False)),
        (1, 3, 2, "drop", (0, False)),  # no version before 0: 1 version old, within the bound
        (10, 4, 2, "wait", (8, False)),  # beyond: the oldest version the bound admits
        (10, 4, 2, "drop", (10, True)),  # beyond: dropped, generated again with the current weights
        (3, 4, 2, "drop", (3, True)),  # 3 versions old (clamped at 0) > 2: dropped
        (10, 5, 0, "wait", (10, False)),  # bound 0: the synchronous loop
    ],
)
def test_generating_version_under_the_bound(current, lag, bound, on_stale, expected):
    assert generating_version(current, lag, bound, on_stale) == expected


def test_generating_version_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="on_stale must be one of"):
        generating_version(3, 1, 1, "skip")


def test_lag_schedule_cycles_or_draws_reproducibly():
    assert [lag_at(s, [0, 2, 1]) for s in range(6)] == [0, 2, 1, 0, 2, 1]
    drawn = [lag_at(s, [0, 1, 2, 3], randomized=True, seed=7) for s in range(200)]
    assert drawn == [
        lag_at(s, [0, 1, 2, 3], randomized=True, seed=7) for s in range(200)
    ]  # a resume draws alike
    assert set(drawn) == {0, 1, 2, 3} and drawn != [lag_at(s, [0, 1, 2, 3], True, seed=8) for s in range(200)]
    assert all(abs(drawn.count(k) / 200 - 0.25) < 0.1 for k in range(4))


@pytest.mark.parametrize("bad", [[], [1, -1], [1.5], "12", [True]])
def test_check_lag_names_the_setting(bad):
    with pytest.raises(ValueError, match="rollout_lag must be None or a non-empty list of ints >= 0"):
        check_lag(bad)
    check_lag(None), check_lag([0, 3])


def test_snapshots_copy_keep_the_newest_and_round_trip():
    live = torch.zeros(3)
    snaps = WeightSnapshots(keep=2)
    for version in (4, 5, 6):
        snaps.put(version, [("w", live)])
        live.add_(1.0)  # the trainer's weights move on in place
    assert snaps.versions() == [5, 6] and 4 not in snaps
    assert snaps.get(5)[0][1].tolist() == [1.0] * 3 and snaps.get(6)[0][1].tolist() == [2.0] * 3
    with pytest.raises(KeyError, match=r"policy version 4 is not kept \(kept: \[5, 6\]\)"):
        snaps.get(4)
    with pytest.raises(ValueError, match="not newer than the newest kept version 6"):
        snaps.put(6, [("w", live)])
    restored = WeightSnapshots(keep=2)
    restored.load_state_dict(snaps.state_dict())
    assert restored.versions() == [5, 6] and torch.equal(restored.get(6)[0][1], snaps.get(6)[0][1])
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        WeightSnapshots(keep=0)


def test_adaptive_bound_follows_the_per_version_drift():
    bound = AdaptiveStalenessBound(max_staleness=8, chi2_target=0.02, decay=0.5)
    assert bound() == 8  # nothing measured yet
    bound.observe(chi2=0.0, mean_sq_staleness=0.0)  # no stale row: nothing learned
    assert bound.per_version_chi2 is None
    bound.observe(chi2=0.05, mean_sq_staleness=25.0)  # rows 5 versions old: c = 0.002
    assert bound.per_version_chi2 == pytest.approx(0.002) and bound() == math.floor(math.sqrt(0.02 / 0.002))
    bound.observe(chi2=0.1, mean_sq_staleness=1.0)  # the policy moves faster: c = 0.5 * 0.002 + 0.5 * 0.1
    assert bound.per_version_chi2 == pytest.approx(0.051) and bound() == 0  # wait for fresh rollouts
    state = bound.state_dict()
    again = AdaptiveStalenessBound(max_staleness=8, chi2_target=0.02, decay=0.5)
    again.load_state_dict(state)
    assert again() == 0
    with pytest.raises(ValueError, match="chi2_target must be a finite number > 0"):
        AdaptiveStalenessBound(2, 0.0)
