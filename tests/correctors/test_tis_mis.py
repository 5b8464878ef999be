"""Hand-derived weights, masks and stats of TIS and MIS at every level, on the worked example.

Token ratios w = pi/mu (conftest.RATIOS), valid tokens marked, response 1 has one padding token:
    response 0: 3.0   0.25  1.5      product 1.125   geometric 1.125**(1/3) = 1.0400419
    response 1: 0.8   1.25  [0.01]   product 1.0     geometric 1.0
    response 2: 0.1   0.2   0.4      product 0.008   geometric 0.2
8 valid tokens.
"""

from __future__ import annotations

import pytest
import torch

from ais_lightning.correctors import MIS, TIS, NoCorrection

GEO0 = 1.125 ** (1.0 / 3.0)  # 1.0400419
T, F = True, False
MASK = [[T, T, T], [T, T, F], [T, T, T]]


def check(out, weights, mask, **stats):
    torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    assert out.weights.dtype == torch.float32
    assert torch.equal(out.mask, torch.tensor(mask, dtype=torch.bool))
    for key, value in stats.items():
        assert out.stats[key.replace("__", "/")] == pytest.approx(value, abs=1e-6), key


def test_raw_ratio_statistics_come_from_the_diagnostics_not_the_corrector(example):
    # The raw ratio statistics moved to ais_lightning.diagnostics (one place, exact under DDP):
    # mean = (3 + .25 + 1.5 + .8 + 1.25 + .1 + .2 + .4) / 8 = 7.5 / 8; the padding 0.01 is ignored.
    # above 2: {3} -> 1/8; below 0.5: {.25, .1, .2, .4} -> 4/8.
    from ais_lightning.diagnostics import RatioStatistic

    expected = {"mean": 0.9375, "min": 0.1, "max": 3.0, "frac_above": 1 / 8, "frac_below": 4 / 8}
    for stat, value in expected.items():
        metric = RatioStatistic(stat, c=2.0)
        metric.update(*example)
        assert float(metric.compute()) == pytest.approx(value, abs=1e-6), stat
    # TIS c_high = 1.4: above {3, 1.5} = 2/8; below 1/1.4 = 0.714: {.25, .1, .2, .4} = 4/8.
    for stat, value in {"frac_above": 2 / 8, "frac_below": 4 / 8}.items():
        metric = RatioStatistic(stat, c=1.4)
        metric.update(*example)
        assert float(metric.compute()) == pytest.approx(value), stat
    for corrector in (NoCorrection(), TIS(), MIS(), TIS(level="sequence"), MIS(level="geometric")):
        assert not any(k.startswith("ratio/") for k in corrector(*example).stats)


def test_no_correction(example):
    check(
        NoCorrection()(*example),
        [[1, 1, 1], [1, 1, 0], [1, 1, 1]],
        [[T, T, T], [T, T, F], [T, T, T]],
        corrector__clipped_frac=0.0,
        corrector__masked_frac=0.0,
        corrector__weight_mean=1.0,
    )


def test_tis_token(example):
    # Only 3.0 exceeds c_high = 2; weight mean (2 + .25 + 1.5 + .8 + 1.25 + .1 + .2 + .4) / 8 = 6.5 / 8.
    check(
        TIS(level="token", c_high=2.0)(*example),
        [[2.0, 0.25, 1.5], [0.8, 1.25, 0.0], [0.1, 0.2, 0.4]],
        [[T, T, T], [T, T, F], [T, T, T]],
        corrector__clipped_frac=1 / 8,
        corrector__masked_frac=0.0,
        corrector__weight_mean=6.5 / 8,
    )


def test_tis_token_with_lower_bound(example):
    # c_low = 0.3 lifts .25, .1, .2 to .3; with the 3.0 -> 2.0 clip that is 4/8 clipped.
    # weight mean (2 + .3 + 1.5 + .8 + 1.25 + .3 + .3 + .4) / 8 = 6.85 / 8.
    check(
        TIS(level="token", c_high=2.0, c_low=0.3)(*example),
        [[2.0, 0.3, 1.5], [0.8, 1.25, 0.0], [0.3, 0.3, 0.4]],
        [[T, T, T], [T, T, F], [T, T, T]],
        corrector__clipped_frac=4 / 8,
        corrector__weight_mean=6.85 / 8,
    )


def test_tis_sequence(example):
    # Products 1.125, 1.0, 0.008 are all <= 2: nothing clipped, broadcast to the valid tokens.
    check(
        TIS(level="sequence", c_high=2.0)(*example),
        [[1.125] * 3, [1.0, 1.0, 0.0], [0.008] * 3],
        [[T, T, T], [T, T, F], [T, T, T]],
        corrector__clipped_frac=0.0,
    )
    # c_high = 1.1 clips response 0 (1.125 -> 1.1), c_low = 0.5 lifts response 2 (0.008 -> 0.5): 6/8 tokens.
    check(
        TIS(level="sequence", c_high=1.1, c_low=0.5)(*example),
        [[1.1] * 3, [1.0, 1.0, 0.0], [0.5] * 3],
        [[T, T, T], [T, T, F], [T, T, T]],
        corrector__clipped_frac=6 / 8,
        corrector__weight_mean=(3 * 1.1 + 2 * 1.0 + 3 * 0.5) / 8,
    )


def test_tis_geometric(example):
    check(
        TIS(level="geometric", c_high=2.0)(*example),
        [[GEO0] * 3, [1.0, 1.0, 0.0], [0.2] * 3],
        [[T, T, T], [T, T, F], [T, T, T]],
        corrector__clipped_frac=0.0,
    )
    # c_high = 1.02 < 1.04 clips response 0; c_low = 0.5 > 0.2 lifts response 2.
    check(
        TIS(level="geometric", c_high=1.02, c_low=0.5)(*example),
        [[1.02] * 3, [1.0, 1.0, 0.0], [0.5] * 3],
        [[T, T, T], [T, T, F], [T, T, T]],
        corrector__clipped_frac=6 / 8,
    )


def test_mis_token(example):
    # Kept in [0.5, 2]: 1.5, 0.8, 1.25. Rejected: 3, .25, .1, .2, .4 -> 5/8 masked.
    check(
        MIS(level="token", c_low=0.5, c_high=2.0)(*example),
        [[0, 0, 1.5], [0.8, 1.25, 0], [0, 0, 0]],
        [[F, F, T], [T, T, F], [F, F, F]],
        corrector__masked_frac=5 / 8,
        corrector__clipped_frac=0.0,
        corrector__weight_mean=(1.5 + 0.8 + 1.25) / 3,
    )


def test_mis_sequence(example):
    # Products 1.125 and 1.0 in [0.5, 2] are kept; 0.008 rejects all of response 2 (3/8 masked).
    check(
        MIS(level="sequence", c_low=0.5, c_high=2.0)(*example),
        [[1.125] * 3, [1.0, 1.0, 0.0], [0, 0, 0]],
        [[T, T, T], [T, T, F], [F, F, F]],
        corrector__masked_frac=3 / 8,
        corrector__weight_mean=(3 * 1.125 + 2 * 1.0) / 5,
    )


def test_mis_geometric(example):
    # [0.15, 1.03]: response 0 (1.04) is rejected, response 1 (1.0) and response 2 (0.2) are kept.
    check(
        MIS(level="geometric", c_low=0.15, c_high=1.03)(*example),
        [[0, 0, 0], [1.0, 1.0, 0.0], [0.2] * 3],
        [[F, F, F], [T, T, F], [T, T, T]],
        corrector__masked_frac=3 / 8,
        corrector__weight_mean=(2 * 1.0 + 3 * 0.2) / 5,
    )


def test_mis_veto_rejects_whole_sequences(example):
    # Every valid ratio is inside [0.05, 4]; veto 0.15 rejects response 2 (it has 0.1 < 0.15).
    # Response 1's padding ratio 0.01 is below the veto but masked, so response 1 survives.
    check(
        MIS(level="token", c_low=0.05, c_high=4.0, veto=0.15)(*example),
        [[3.0, 0.25, 1.5], [0.8, 1.25, 0.0], [0, 0, 0]],
        [[T, T, T], [T, T, F], [F, F, F]],
        corrector__masked_frac=3 / 8,
    )
    # veto 0.09: no valid ratio below it, everything kept.
    out = MIS(level="token", c_low=0.05, c_high=4.0, veto=0.09)(*example)
    assert torch.equal(out.mask, torch.tensor(MASK, dtype=torch.bool))


def test_mis_veto_applies_at_sequence_level(example):
    # Sequence level keeps products 1.125 and 1.0 and rejects 0.008; veto 0.3 also rejects
    # response 0 (its token 0.25 < 0.3) although its product is in range.
    check(
        MIS(level="sequence", c_low=0.5, c_high=2.0, veto=0.3)(*example),
        [[0, 0, 0], [1.0, 1.0, 0.0], [0, 0, 0]],
        [[F, F, F], [T, T, F], [F, F, F]],
        corrector__masked_frac=6 / 8,
    )


def test_outputs_are_detached_even_with_grad_inputs(example):
    train, rollout, mask = example
    train = train.clone().requires_grad_(True)
    for corrector in (NoCorrection(), TIS(), MIS()):
        out = corrector(train, rollout, mask)
        assert not out.weights.requires_grad
        assert all(isinstance(v, float) for v in out.stats.values())
