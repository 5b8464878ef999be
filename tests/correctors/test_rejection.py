"""verl's divergence rejection (``DivergenceRejection``) by hand on the worked example of conftest.py.

Token ratios w = pi/mu, valid tokens only (response 1's third token is padding, ratio 0.01):
    response 0: 3.0   0.25  1.5      product 1.125   geometric mean 1.04004
    response 1: 0.8   1.25  [0.01]   product 1.0     geometric mean 1.0
    response 2: 0.1   0.2   0.4      product 0.008   geometric mean 0.2
Per-token statistics (delta = ln w):
    w      ln w       k2 = ln^2 w / 2   k3 = w - 1 - ln w
    3.0    1.098612   0.603474          0.901388
    0.25  -1.386294   0.960906          0.636294
    1.5    0.405465   0.082201          0.094535
    0.8   -0.223144   0.024897          0.023144
    1.25   0.223144   0.024897          0.026856
    0.1   -2.302585   2.650949          1.402585
    0.2   -1.609438   1.295145          0.809438
    0.4   -0.916291   0.419795          0.316291
The padding token (k3(0.01) = 3.6) must never matter, e.g. for seq_max_k3.
"""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.correctors import RS_OPTIONS, DivergenceRejection

T, F = True, False
VALID = [[T, T, T], [T, T, F], [T, T, T]]


def rows(*kept: int) -> list[list[bool]]:
    """The valid tokens of the responses ``kept``."""
    return [[v and i in kept for v in row] for i, row in enumerate(VALID)]


def k2(w: float) -> float:
    return 0.5 * math.log(w) ** 2


def k3(w: float) -> float:
    return w - 1.0 - math.log(w)


def assert_keep(out, keep):
    assert torch.equal(out.mask, torch.tensor(keep)), out.mask


@pytest.mark.parametrize(
    ("kwargs", "keep"),
    [
        # token_k1 = 2: two-sided, 1/2 <= w <= 2 (verl: lower = 1/upper): keeps 1.5, 0.8, 1.25.
        (dict(token_k1=2.0), [[F, F, T], [T, T, F], [F, F, F]]),
        # verl "0.2_2.0": 0.2 <= mu/pi <= 2, i.e. 0.5 <= w <= 5: 3.0 is now kept, 0.25 / 0.4 still out.
        (dict(token_k1=2.0, token_k1_lower=0.2), [[T, F, T], [T, T, F], [F, F, F]]),
        # k2 <= 0.5  <=>  |ln w| <= 1  <=>  w in [0.368, 2.718]: 1.5, 0.8, 1.25, 0.4.
        (dict(token_k2=0.5), [[F, F, T], [T, T, F], [F, F, T]]),
        # k3 <= 0.5: 1.5 (0.095), 0.8 (0.023), 1.25 (0.027), 0.4 (0.316); 0.25 (0.636) is out.
        (dict(token_k3=0.5), [[F, F, T], [T, T, F], [F, F, T]]),
        # k3 <= 0.7: also 0.25 (0.636) -- asymmetric: 3.0 (0.901) is out though |ln 3| < |ln 0.25|.
        (dict(token_k3=0.7), [[F, T, T], [T, T, F], [F, F, T]]),
        # seq_sum_k1 = 2: products 1.125, 1.0 in [0.5, 2]; 0.008 out.
        (dict(seq_sum_k1=2.0), rows(0, 1)),
        # seq_mean_k1 = 1.1: geometric means 1.04 (mu/pi 0.96), 1.0 in [1/1.1, 1.1]; 0.2 (mu/pi 5) out.
        (dict(seq_mean_k1=1.1), rows(0, 1)),
        # seq_mean_k1 = 1.03: 1.04 -> mu/pi = 0.9615 < 1/1.03 = 0.9709: response 0 out too.
        (dict(seq_mean_k1=1.03), rows(1)),
        # seq_sum_k2: sums 1.646581, 0.049793, 4.365889 -> threshold 1.7 keeps 0, 1.
        (dict(seq_sum_k2=1.7), rows(0, 1)),
        # seq_sum_k3: sums 1.632217, 0.050000, 2.528314 -> threshold 0.06 keeps only 1.
        (dict(seq_sum_k3=0.06), rows(1)),
        # seq_mean_k2: means 0.548860, 0.024897, 1.455296 -> 0.55 keeps 0, 1.
        (dict(seq_mean_k2=0.55), rows(0, 1)),
        # seq_mean_k3: means 0.544072, 0.025000, 0.842771 -> 0.1 keeps only 1.
        (dict(seq_mean_k3=0.1), rows(1)),
        # seq_max_k2: maxima 0.960906, 0.024897, 2.650949 -> 0.97 keeps 0, 1.
        (dict(seq_max_k2=0.97), rows(0, 1)),
        # seq_max_k3: maxima 0.901388, 0.026856 (not the padding's 3.6), 1.402585 -> 0.95 keeps 0, 1.
        (dict(seq_max_k3=0.95), rows(0, 1)),
    ],
)
def test_each_option_by_hand(example, kwargs, keep):
    out = DivergenceRejection(**kwargs)(*example)
    assert_keep(out, keep)
    # Kept tokens weigh 1 without tis_level; rejected tokens leave the denominator.
    torch.testing.assert_close(out.weights, torch.tensor(keep, dtype=torch.float32))
    n_rejected = sum(v and not k for vr, kr in zip(VALID, keep) for v, k in zip(vr, kr))
    assert out.stats["corrector/masked_frac"] == pytest.approx(n_rejected / 8)
    assert out.stats["rs/masked_frac"] == pytest.approx(n_rejected / 8)
    (option,) = [k for k in kwargs if not k.endswith("_lower")]
    assert out.stats[f"rs/{option}/masked_frac"] == pytest.approx(n_rejected / 8)


def test_statistics_of_each_option(example):
    # rs/<o>/mean is the token mean of the statistic (sequence statistics broadcast to their tokens,
    # as verl's rollout_rs_<o>_mean); rs/<o>/max the largest.
    ws = [3.0, 0.25, 1.5, 0.8, 1.25, 0.1, 0.2, 0.4]
    per_row = [ws[:3], ws[3:5], ws[5:]]
    out = DivergenceRejection(token_k1=2.0, seq_sum_k3=10.0, seq_max_k2=10.0, seq_mean_k1=10.0)(*example)
    assert out.stats["rs/token_k1/mean"] == pytest.approx(sum(-math.log(w) for w in ws) / 8, rel=1e-5)
    assert out.stats["rs/token_k1/max"] == pytest.approx(-math.log(0.1), rel=1e-5)
    sums = [sum(k3(w) for w in r) for r in per_row]
    assert out.stats["rs/seq_sum_k3/mean"] == pytest.approx(
        (3 * sums[0] + 2 * sums[1] + 3 * sums[2]) / 8, rel=1e-5
    )
    assert out.stats["rs/seq_sum_k3/max"] == pytest.approx(sums[2], rel=1e-5)
    assert out.stats["rs/seq_max_k2/max"] == pytest.approx(k2(0.1), rel=1e-5)
    geo = [-sum(math.log(w) for w in r) / len(r) for r in per_row]  # seq_mean_k1 = mean of -ln w
    assert out.stats["rs/seq_mean_k1/mean"] == pytest.approx(
        (3 * geo[0] + 2 * geo[1] + 3 * geo[2]) / 8, rel=1e-5
    )
    # Only token_k1 rejects here: 3.0, 0.25 (response 0), 0.1, 0.2, 0.4 (response 2).
    assert out.stats["rs/seq_masked_frac"] == pytest.approx(2 / 3)
    assert out.stats["rs/token_k1/seq_masked_frac"] == pytest.approx(2 / 3)
    assert out.stats["rs/seq_sum_k3/masked_frac"] == 0.0


def test_several_options_must_all_pass(example):
    # seq_max_k3 = 0.95 rejects response 2 (3 tokens); token_k2 = 0.5 rejects 3.0, 0.25, 0.1, 0.2.
    # Union: 3.0, 0.25, 0.1, 0.2, 0.4 -> 5/8 rejected, 1.5, 0.8, 1.25 stay.
    out = DivergenceRejection(seq_max_k3=0.95, token_k2=0.5)(*example)
    assert_keep(out, [[F, F, T], [T, T, F], [F, F, F]])
    assert out.stats["rs/seq_max_k3/masked_frac"] == pytest.approx(3 / 8)
    assert out.stats["rs/token_k2/masked_frac"] == pytest.approx(4 / 8)
    assert out.stats["rs/masked_frac"] == pytest.approx(5 / 8)
    assert out.stats["corrector/masked_frac"] == pytest.approx(5 / 8)


def test_with_token_tis_and_batch_normalization(example):
    # token_k1 = 2 keeps 1.5, 0.8, 1.25; token TIS at C = 2 gives them min(w, 2) = w.
    out = DivergenceRejection(token_k1=2.0, tis_level="token", tis_c_high=2.0)(*example)
    torch.testing.assert_close(out.weights, torch.tensor([[0, 0, 1.5], [0.8, 1.25, 0], [0, 0, 0]]))
    assert out.stats["corrector/clipped_frac"] == 0.0  # the clipped 3.0 was rejected
    # C = 1.4 clips the kept 1.5: weight 1.4, clipped 1/8.
    out = DivergenceRejection(token_k1=2.0, tis_level="token", tis_c_high=1.4)(*example)
    torch.testing.assert_close(out.weights, torch.tensor([[0, 0, 1.4], [0.8, 1.25, 0], [0, 0, 0]]))
    assert out.stats["corrector/clipped_frac"] == pytest.approx(1 / 8)
    # Batch normalisation, like verl, over the valid tokens before rejection: truncated weights
    # 2, .25, 1.5, .8, 1.25, .1, .2, .4 sum to 6.5, mean 0.8125.
    out = DivergenceRejection(token_k1=2.0, tis_level="token", tis_batch_normalize=True)(*example)
    torch.testing.assert_close(out.weights, torch.tensor([[0, 0, 1.5], [0.8, 1.25, 0], [0, 0, 0]]) / 0.8125)
    assert out.stats["tis/batch_norm_factor"] == pytest.approx(0.8125)


def test_sequence_rejection_with_sequence_tis(example):
    # verl decoupled_seq_is_rs: seq_sum_k1 "0.5_2.0" keeps responses 0, 1; sequence TIS at 2 gives
    # them their products 1.125 and 1.0.
    out = DivergenceRejection(seq_sum_k1=2.0, tis_level="sequence")(*example)
    torch.testing.assert_close(out.weights, torch.tensor([[1.125] * 3, [1.0, 1.0, 0.0], [0.0] * 3]))
    # geometric TIS level with geo rejection at +-5%: response 0 (1.04) and 1 (1.0) kept.
    out = DivergenceRejection(seq_mean_k1=1.05, tis_level="geometric")(*example)
    geo0 = 1.125 ** (1 / 3)
    torch.testing.assert_close(out.weights, torch.tensor([[geo0] * 3, [1.0, 1.0, 0.0], [0.0] * 3]))


def test_ragged_rows_use_only_their_valid_tokens(make_logprobs):
    # Row 0 has one valid token (w = 1.2), row 1 four (w = 1.2 and three large padded values):
    # seq_sum_k2 must sum over 1 and 2 tokens respectively, not over the padded length.
    train, rollout, mask = make_logprobs(
        [[1.2, 50.0, 50.0, 50.0], [1.2, 1.2, 0.02, 0.02]], [[T, F, F, F], [T, T, F, F]]
    )
    threshold = 1.5 * k2(1.2)  # row 0: k2(1.2) passes; row 1: 2 k2(1.2) fails
    out = DivergenceRejection(seq_sum_k2=threshold)(train, rollout, mask)
    assert_keep(out, [[T, F, F, F], [F, F, F, F]])
    out = DivergenceRejection(seq_mean_k2=threshold / 1.5 * 1.01)(train, rollout, mask)  # means equal
    assert_keep(out, [[T, F, F, F], [T, T, F, F]])


def test_on_policy_keeps_everything(example):
    train, rollout, mask = example
    out = DivergenceRejection(**{o: 1.0001 if o.endswith("k1") else 1e-9 for o in RS_OPTIONS})(
        rollout.clone(), rollout, mask
    )
    assert torch.equal(out.mask, mask)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(token_k2=-1.0), "token_k2"),
        (dict(token_k2=0.0), "token_k2"),
        (dict(seq_max_k3=float("inf")), "seq_max_k3"),
        (dict(token_k1=0.5), "token_k1"),  # a ratio bound < 1 would reject on-policy tokens
        (dict(seq_mean_k1=True), "seq_mean_k1"),
        (dict(token_k1=2.0, token_k1_lower=1.5), "token_k1_lower"),
        (dict(token_k1=2.0, token_k1_lower=0.0), "token_k1_lower"),
        (dict(seq_sum_k1_lower=0.5), "seq_sum_k1_lower"),  # without the upper bound
        (dict(tis_level="tokens"), "tis_level"),
        (dict(tis_level="token", tis_c_high=0.5), "tis_c_high"),
        (dict(tis_batch_normalize=True), "tis_batch_normalize"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        DivergenceRejection(**kwargs)
