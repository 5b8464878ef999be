"""Outlier channel splitting: exact identity, layout, rounding-aware levels, lower error with outliers."""

import pytest
import torch
import torch.nn.functional as F

from ais_lightning.quant import (
    dequantize,
    fake_quantize,
    merge_split,
    ocs_split,
    quantize,
    rounding_aware_pieces,
    select_outlier_channels,
)

U = 2.0**-24
"""Unit roundoff of float32."""


def _outlier_weight(n=64, k=256, cols=(3, 17, 100, 200), factor=15.0, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[:, list(cols)] *= factor
    return w


def _element_scale(q, shape):
    bm, bk = q.block
    return q.effective_scale().repeat_interleave(bm, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def test_selection_and_layout():
    w = _outlier_weight()
    split = ocs_split(w, n_split=4)
    assert split.channels.tolist() == [3, 17, 100, 200]  # the injected outlier columns, ascending
    assert split.weight.shape == (64, 260) and split.n_split == 4 and split.in_features == 256
    assert split.index.tolist() == list(range(256)) + [3, 17, 100, 200]
    assert ocs_split(w, ratio=0.01).n_split == 3  # ceil(0.01 * 256)
    assert ocs_split(w, ratio=0.0).weight.shape == (64, 256)
    # Ties go to the lower index; a channel is split at most once.
    tied = torch.ones(2, 5)
    assert select_outlier_channels(tied, 2).tolist() == [0, 1]
    assert ocs_split(tied, n_split=5).channels.tolist() == [0, 1, 2, 3, 4]


def test_plain_split_is_exact():
    w = _outlier_weight()
    split = ocs_split(w, n_split=4)
    assert torch.equal(split.merge(), w)  # w/2 + (w - w/2) == w bit for bit
    assert torch.equal(split.weight[:, 256:], split.weight[:, [3, 17, 100, 200]])  # both halves w/2
    # Exact layer outputs when every product and sum is exact in fp32: dyadic weights, integer inputs.
    g = torch.Generator().manual_seed(1)
    wd = torch.randint(-64, 64, (8, 32), generator=g).float() / 16  # multiples of 1/16
    wd[:, 5] *= 8
    x = torch.randint(-8, 8, (4, 32), generator=g).float()
    sd = ocs_split(wd, n_split=2)
    assert torch.equal(F.linear(sd.expand_input(x), sd.weight), F.linear(x, wd))


def test_split_linear_equals_original_within_the_dot_product_bound():
    """Random fp32: y' = x' W'^T and y = x W^T are both within gamma_n |x| |W|^T of the exact product
    (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5: gamma_n = n u / (1 - n u), any order)."""
    w = _outlier_weight()
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    for split in (ocs_split(w, n_split=8), ocs_split(w, n_split=8, fmt="nint4")):
        xs = split.expand_input(x)  # [16, 264]
        y_split, y = F.linear(xs, split.weight), F.linear(x, w)
        g1, g2 = 264 * U / (1 - 264 * U), 256 * U / (1 - 256 * U)
        piece_error = U * split.weight[:, 256:].abs()  # |a + b - w| <= 2^-24 |b| (one rounding of b)
        bound = g1 * (xs.abs() @ split.weight.abs().T) + g2 * (x.abs() @ w.abs().T)
        bound += x[:, split.channels].abs() @ piece_error.T
        assert ((y_split - y).abs() <= bound).all()
        assert (y_split - y).abs().max() > 0 or torch.equal(y_split, y)


def test_rounding_aware_split_sums_to_w():
    w = _outlier_weight()
    split = ocs_split(w, n_split=8, fmt="nint4")
    ch = split.channels
    a, b = split.weight[:, ch], split.weight[:, 256:]
    merged, cols = split.merge(), w[:, ch]
    rest = torch.ones(256, dtype=torch.bool)
    rest[ch] = False
    assert torch.equal(merged[:, rest], w[:, rest])
    assert ((merged[:, ch] - cols).abs() <= 2 * U * b.abs() + 1e-30).all()
    # Sterbenz: where the larger piece has w's sign and lies in [|w|/2, 2|w|], w - piece is exact.
    big = torch.where(a.abs() >= b.abs(), a, b)
    exact = (big * cols > 0) & (2 * big.abs() >= cols.abs()) & (big.abs() <= 2 * cols.abs())
    assert torch.equal(merged[:, ch][exact], cols[exact])
    assert exact[cols.abs() > 4].all()  # every outlier entry (|w| > 4, steps ~0.2..2) is exact


@pytest.mark.parametrize("fmt", ["nint8", "nint4", "nint2", "int8"])
def test_equal_scales_give_the_correctly_rounded_w_on_the_zero_grid(fmt):
    """Per-row scale ("channel"): s_a = s_b = s, and the pieces' levels sum to round_half_up(w / s) * s."""
    w = _outlier_weight()
    split = ocs_split(w, n_split=6, fmt=fmt, scaling="channel")
    ch = split.channels
    q = split.dequantized()
    levels_sum = q[:, ch] + q[:, 256:]  # [N, S]
    s = split.quantized.scale  # [N, 1]
    cols = w[:, ch]
    # Reach of the pair: nested b bits: levels (c_a + c_b + 1) s up to (2^b - 1) s; int8: 254 s.
    reach = (2 ** int(fmt[-1]) - 1) * s if fmt.startswith("nint") else 254 * s
    inside = cols.abs() <= reach
    expected = torch.floor(cols / s + 0.5) * s
    assert torch.allclose(levels_sum[inside], expected[inside], rtol=1e-6, atol=0)
    # Outside: a row's largest |w| maps to 2^b s (the scale comes from amax(w / 2)), one step beyond the
    # pair's reach; it saturates to (2^b - 1) s, an error of s, as the unsplit grid's top level (step 2 s).
    slack = 1e-5 * cols.abs()  # fp32 rounding of values up to 2^b s
    assert ((levels_sum - cols).abs() <= s + slack)[~inside].all()
    assert inside.float().mean() > 0.6


@pytest.mark.parametrize("scaling", ["group_e4m3", "channel", "group"])
@pytest.mark.parametrize("fmt", ["nint4", "nint2"])
def test_rounding_aware_levels_are_what_the_planned_scales_give(fmt, scaling):
    """Each piece sits a quarter step inside its cell: requantizing with the plan's scales gives its level,
    and the merged error is at most half the finer of the two steps (unsaturated entries)."""
    w = _outlier_weight()
    split = ocs_split(w, n_split=8, fmt=fmt, scaling=scaling)
    k, ch = 256, split.channels
    naive = torch.cat([w.index_copy(1, ch, w[:, ch] / 2), w[:, ch] / 2], dim=1)
    plan = quantize(naive, fmt, scaling)
    assert torch.equal(split.quantized.scale, plan.scale)
    # Columns that were not split quantize exactly as in the plan.
    keep = torch.ones(k + 8, dtype=torch.bool)
    keep[ch] = False
    keep[k:] = False
    assert torch.equal(split.quantized.data[:, keep], plan.data[:, keep])
    # Every piece is >= 1/4 step inside its cell [c, c + 1) on the scaled values (robust to rounding);
    # the extreme cells are open outwards (saturation), so only their inner edge counts.
    step = _element_scale(plan, naive.shape)  # [N, K + S]
    pieces = torch.cat([ch, torch.arange(k, k + 8)])
    y = (split.weight / step)[:, pieces]  # [N, 2 S]
    half = 2 ** (int(fmt[-1]) - 1)
    c = torch.floor(y).clamp(-half, half - 1)
    assert ((y - c >= 0.25 - 1e-4) | (c == -half)).all()
    assert ((y - c <= 0.75 + 1e-4) | (c == half - 1)).all()
    # Merged error <= min(s_a, s_b) / 2 where neither piece is in an extreme cell.
    merged_q = split.merge(split.dequantized())[:, ch]
    s_min = torch.minimum(step[:, ch], step[:, k:])
    extreme = (c == -half) | (c == half - 1)
    ok = ~(extreme[:, :8] | extreme[:, 8:])
    assert ok.float().mean() > 0.2  # at 2 bits half the cells are extreme
    assert ((merged_q - w[:, ch]).abs()[ok] <= s_min[ok] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("scaling", ["group_e4m3", "channel"])
@pytest.mark.parametrize("fmt", ["nint4", "nint2"])
def test_lower_mse_with_outliers(fmt, scaling):
    w = _outlier_weight()
    mse_none = ((fake_quantize(w, fmt, scaling) - w) ** 2).mean()
    aware = ocs_split(w, ratio=0.05, fmt=fmt, scaling=scaling)
    mse_aware = ((aware.merge(aware.dequantized()) - w) ** 2).mean()
    plain = ocs_split(w, ratio=0.05)
    mse_plain = ((plain.merge(fake_quantize(plain.weight, fmt, scaling)) - w) ** 2).mean()
    assert mse_aware < 0.5 * mse_none  # measured 3-5x lower
    assert mse_aware < mse_plain  # rounding-aware beats plain halving at the same split


def test_rounding_aware_pieces_by_hand():
    """nint4, s_a = s_b = 0.25: w = 1.3 -> coarse level round(0.65 / 0.25 = 2.6 -> cell 2) = 2.5 * 0.25 = 0.625;
    the fine piece carries 0.675 -> cell 2 -> 0.625; r = 0.05, split evenly: a = 0.65, b = 0.65."""
    w = torch.tensor([1.3])
    s = torch.tensor([0.25])
    a, b = rounding_aware_pieces(w, s, s, "nint4")
    assert a.item() == pytest.approx(0.65, abs=1e-6) and b.item() == pytest.approx(0.65, abs=1e-6)
    # Unequal steps: s_a = 0.5 (coarse, first): 0.65 / 0.5 = 1.3 -> cell 1 -> 0.75; carry 0.55 on 0.25
    # -> cell 2 -> 0.625; r = -0.075; a gets 2/3 of it: 0.7, b gets 1/3: 0.6. Merged levels 1.375 (|err| 0.075).
    a, b = rounding_aware_pieces(w, torch.tensor([0.5]), s, "nint4")
    assert a.item() == pytest.approx(0.7, abs=1e-6) and b.item() == pytest.approx(0.6, abs=1e-6)
    assert (a + b).item() == pytest.approx(1.3, abs=1e-7)


def test_merge_split_and_bad_input():
    w = _outlier_weight()
    split = ocs_split(w, n_split=3)
    assert torch.equal(merge_split(split.weight, split.channels, 256), split.merge())
    with pytest.raises(ValueError, match="exactly one of ratio or n_split"):
        ocs_split(w)
    with pytest.raises(ValueError, match="exactly one of ratio or n_split"):
        ocs_split(w, ratio=0.1, n_split=2)
    with pytest.raises(ValueError, match="ratio must be"):
        ocs_split(w, ratio=1.5)
    with pytest.raises(ValueError, match="n_split must be"):
        ocs_split(w, n_split=300)
    with pytest.raises(ValueError, match="integer format"):
        ocs_split(w, n_split=2, fmt="fp4_e2m1")
    with pytest.raises(ValueError, match="2-D"):
        ocs_split(w[0], n_split=1)
    with pytest.raises(ValueError, match="non-finite"):
        ocs_split(torch.tensor([[1.0, float("nan")]]), n_split=1)
    with pytest.raises(ValueError, match="features"):
        split.expand_input(torch.zeros(2, 255))
    with pytest.raises(ValueError, match="fmt=None"):
        split.dequantized()
    with pytest.raises(ValueError, match=r"\[N, 259\]"):
        merge_split(w, split.channels, 256)
    assert dequantize(ocs_split(w, n_split=0, fmt="nint4").quantized).shape == (64, 256)
