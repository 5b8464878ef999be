"""IcePop (weights zeroed, tokens kept in the denominator) beside MIS, and batch-normalised TIS, by hand.

Worked example of conftest.py, 8 valid tokens:
    response 0: 3.0   0.25  1.5      product 1.125
    response 1: 0.8   1.25  [0.01]   product 1.0
    response 2: 0.1   0.2   0.4      product 0.008
"""

from __future__ import annotations

import pytest
import torch

from ais_lightning.correctors import MIS, BatchNormalizedTIS, IcePop, batch_normalize
from ais_lightning.losses import aggregate

T, F = True, False
VALID = torch.tensor([[T, T, T], [T, T, F], [T, T, T]])


def test_icepop_zeroes_out_of_band_weights_and_keeps_the_tokens(example):
    # Band [0.5, 5]: 0.25, 0.1, 0.2, 0.4 are zeroed; 3.0 (<= 5) keeps its weight.
    out = IcePop()(*example)
    torch.testing.assert_close(out.weights, torch.tensor([[3.0, 0, 1.5], [0.8, 1.25, 0], [0, 0, 0]]))
    assert torch.equal(out.mask, VALID)
    assert out.stats["corrector/masked_frac"] == 0.0
    assert out.stats["corrector/clipped_frac"] == pytest.approx(4 / 8)
    assert out.stats["icepop/zeroed_frac"] == pytest.approx(4 / 8)


def test_icepop_loss_is_mis_loss_scaled_by_the_kept_fraction(example):
    # Same band for both. MIS keeps 3.0, 1.5, 0.8, 1.25 and drops the rest from the denominator.
    ice, mis = IcePop(c_low=0.5, c_high=5.0)(*example), MIS(c_low=0.5, c_high=5.0)(*example)
    torch.testing.assert_close(ice.weights, mis.weights)
    assert int(mis.mask.sum()) == 4 and int(ice.mask.sum()) == 8
    per_token_loss = torch.ones(3, 3)
    # token-mean: MIS (3 + 1.5 + .8 + 1.25) / 4 = 1.6375; IcePop 6.55 / 8 = 0.81875 = MIS * 4/8.
    loss_mis = aggregate(mis.weights * per_token_loss, mis.mask, "token-mean")
    loss_ice = aggregate(ice.weights * per_token_loss, ice.mask, "token-mean")
    assert float(loss_mis) == pytest.approx(6.55 / 4)
    assert float(loss_ice) == pytest.approx(6.55 / 8)
    # seq-mean-token-mean: MIS drops response 2 from the sequence count, IcePop keeps it at 0:
    # MIS ((3 + 1.5)/2 + (.8 + 1.25)/2) / 2 = 1.6375; IcePop ((4.5/3) + (2.05/2) + 0) / 3 = 0.841667.
    assert float(aggregate(mis.weights, mis.mask, "seq-mean-token-mean")) == pytest.approx(1.6375)
    assert float(aggregate(ice.weights, ice.mask, "seq-mean-token-mean")) == pytest.approx(
        (4.5 / 3 + 2.05 / 2) / 3
    )


def test_icepop_sequence_level_is_trl_sequence_mask(example):
    # Products 1.125, 1.0, 0.008 with band [0.5, 2]: response 2 gets weight 0 but stays in the mask.
    out = IcePop(level="sequence", c_low=0.5, c_high=2.0)(*example)
    torch.testing.assert_close(out.weights, torch.tensor([[1.125] * 3, [1.0, 1.0, 0.0], [0.0] * 3]))
    assert torch.equal(out.mask, VALID)


def test_batch_normalized_token_tis(example):
    # Truncated at 2: 2, .25, 1.5, .8, 1.25, .1, .2, .4 -> sum 6.5, mean 0.8125; divide.
    out = BatchNormalizedTIS(c_high=2.0)(*example)
    expected = torch.tensor([[2.0, 0.25, 1.5], [0.8, 1.25, 0.0], [0.1, 0.2, 0.4]]) / 0.8125
    torch.testing.assert_close(out.weights, expected)
    assert float(out.weights[VALID].mean()) == pytest.approx(1.0)
    assert out.stats["tis/batch_norm_factor"] == pytest.approx(0.8125)
    assert out.stats["corrector/clipped_frac"] == pytest.approx(1 / 8)
    assert torch.equal(out.mask, VALID)


def test_batch_normalized_sequence_tis_averages_over_sequences(example):
    # One weight per response: 1.125, 1.0, 0.008 (none above 2), mean 2.133 / 3 = 0.711.
    out = BatchNormalizedTIS(level="sequence")(*example)
    mean = 2.133 / 3
    expected = torch.tensor([[1.125] * 3, [1.0, 1.0, 0.0], [0.008] * 3]) / mean
    torch.testing.assert_close(out.weights, expected)
    assert out.stats["tis/batch_norm_factor"] == pytest.approx(mean)
    # The per-sequence weights average 1 (the per-token ones do not: response 1 is shorter).
    assert float(out.weights[:, 0].mean()) == pytest.approx(1.0)


def test_batch_normalize_leaves_tiny_or_empty_batches_alone():
    weights = torch.full((2, 3), 1e-9)
    mask = torch.ones(2, 3, dtype=torch.bool)
    normalized, factor = batch_normalize(weights, mask, "token")  # mean 1e-9 <= 1e-8: verl's guard
    assert float(factor) == 1.0 and torch.equal(normalized, weights)
    normalized, factor = batch_normalize(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool), "sequence")
    assert float(factor) == 1.0


@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (lambda: IcePop(c_low=0.6, c_high=0.9), "c_high"),
        (lambda: IcePop(c_low=1.5), "c_low"),
        (lambda: IcePop(level="seq"), "level"),
        (lambda: BatchNormalizedTIS(c_high=0.5), "c_high"),
        (lambda: BatchNormalizedTIS(level="tok"), "level"),
    ],
)
def test_bad_arguments_name_themselves(factory, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        factory()
