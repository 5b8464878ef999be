"""Tests for ais_lightning.losses.TBPOLoss: hand-derived values for every branch, gradients, validation."""

import math

import pytest
import torch

from ais_lightning.losses import GRPOLoss, LossOutput, TBPOLoss

F64 = torch.float64
NAN = float("nan")
WIDE = dict(epsilon_low=0.2, epsilon_high=0.2)  # token-PPO-sized clip range, easy hand numbers


def _batch(ratios, advantages, mismatches=None, length=3, spread=0.3):
    """One sequence per entry, each with ``length`` tokens of which the last one is padding.

    The valid token log-ratios are ``log r +- spread`` (so only their mean, the geometric mean ratio
    r, is fixed), likewise ``log m -+ spread`` for pi_old / mu. Padding holds -inf / NaN.
    """
    b = len(ratios)
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[:, -1] = False
    wiggle = torch.tensor([spread, -spread] + [0.0] * (length - 3), dtype=F64)  # [T-1], mean 0
    old = torch.linspace(-2.0, -0.5, length - 1, dtype=F64).expand(b, -1)  # [B, T-1]
    logp = old + torch.tensor(ratios, dtype=F64).log().unsqueeze(-1) + wiggle  # [B, T-1]
    pad = torch.full((b, 1), -math.inf, dtype=F64)
    out = {
        "logprobs": torch.cat([logp, pad], dim=-1).requires_grad_(True),
        "old_logprobs": torch.cat([old, pad], dim=-1),
        "advantages": torch.tensor(advantages, dtype=F64),
        "mask": mask,
    }
    if mismatches is not None:
        roll = old - torch.tensor(mismatches, dtype=F64).log().unsqueeze(-1) - wiggle  # [B, T-1]
        out["rollout_logprobs"] = torch.cat([roll, torch.full((b, 1), NAN, dtype=F64)], dim=-1)
    return out


def test_unclipped_clipped_high_and_low_hand_values():
    # eps 0.2, L = -min(rA, clip(r, 0.8, 1.2) A):
    #  r=1.1 A=+1 -> -1.1 (inside)        r=1.5 A=+1 -> -1.2 (clipped high)
    #  r=0.5 A=-1 -> +0.8 (clipped low)   r=0.5 A=+1 -> -0.5 (unclipped branch is the min)
    out = TBPOLoss(**WIDE)(**_batch([1.1, 1.5, 0.5, 0.5], [1.0, 1.0, -1.0, 1.0]))
    assert isinstance(out, LossOutput)
    assert out.loss.item() == pytest.approx((-1.1 - 1.2 + 0.8 - 0.5) / 4)
    assert out.stats["loss/pg_loss"] == pytest.approx(-0.5)
    assert out.stats["loss/total"] == pytest.approx(-0.5)
    assert out.stats["tbpo/clipfrac"] == pytest.approx(0.5)
    assert out.stats["tbpo/dual_clipfrac"] == 0.0
    assert out.stats["tbpo/ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5 + 0.5) / 4)
    assert out.stats["tbpo/kept_frac"] == 1.0
    assert out.stats["tbpo/mismatch_mean"] == 1.0  # no rollout_logprobs: m = 1
    assert all(isinstance(v, float) for v in out.stats.values())


def test_ratio_is_the_geometric_mean_not_the_product():
    # tokens log-ratios ln(1.1) +- 0.3: product of token ratios = 1.21, geometric mean = 1.1.
    batch = _batch([1.1], [1.0], spread=0.3)
    out = TBPOLoss(**WIDE)(**batch)
    assert out.loss.item() == pytest.approx(-1.1)


def test_default_clip_range_is_gspo_sized():
    # defaults eps_low=3e-4, eps_high=4e-4: r=1.01, A=+1 -> -1.0004; r=0.99, A=-1 -> +0.9997
    out = TBPOLoss()(**_batch([1.01, 0.99], [1.0, -1.0]))
    assert out.loss.item() == pytest.approx((-1.0004 + 0.9997) / 2, rel=1e-9)
    assert out.stats["tbpo/clipfrac"] == 1.0


def test_dual_clip_hand_values():
    # eps 0.2, dual_clip 3, for A < 0: min(|A| max(r, clip r), 3 |A|):
    #  r=5 A=-1 -> min(5, 3) = 3 (active)   r=4 A=-2 -> min(8, 6) = 6 (active)
    #  r=2 A=-1 -> 2                         r=5 A=+1 -> -1.2 (clipped high; dual clip only for A < 0)
    batch = _batch([5.0, 4.0, 2.0, 5.0], [-1.0, -2.0, -1.0, 1.0])
    out = TBPOLoss(dual_clip=3.0, **WIDE)(**batch)
    assert out.loss.item() == pytest.approx((3.0 + 6.0 + 2.0 - 1.2) / 4)
    assert out.stats["tbpo/dual_clipfrac"] == pytest.approx(0.5)
    assert out.stats["tbpo/clipfrac"] == pytest.approx(0.25)
    plain = TBPOLoss(dual_clip=None, **WIDE)(**batch)
    assert plain.loss.item() == pytest.approx((5.0 + 8.0 + 2.0 - 1.2) / 4)
    assert plain.stats["tbpo/dual_clipfrac"] == 0.0


def _band_batch():
    # ratio 1 everywhere, so L_i = -A_i. Mismatch m = [1, 0.4, 3, 1.5] with band [0.5, 2]:
    # seq1 dropped low, seq2 dropped high; a 5th sequence is fully masked (not a sequence at all).
    batch = _batch(
        [1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 5.0, 7.0, -2.0, 9.0], mismatches=[1.0, 0.4, 3.0, 1.5, 1.0]
    )
    batch["mask"][4] = False
    return batch


def test_band_drops_low_and_high_and_shrinks_the_denominator():
    out = TBPOLoss(**WIDE)(**_band_batch())
    # kept: seq0 (m=1, L=-1) and seq3 (m=1.5, L=+2): weighted mean over the 2 kept sequences.
    assert out.loss.item() == pytest.approx((-1.0 * 1.0 + 2.0 * 1.5) / 2)
    assert out.stats["tbpo/kept_frac"] == pytest.approx(0.5)
    assert out.stats["tbpo/drop_low_frac"] == pytest.approx(0.25)
    assert out.stats["tbpo/drop_high_frac"] == pytest.approx(0.25)
    assert out.stats["tbpo/mismatch_mean"] == pytest.approx((1.0 + 0.4 + 3.0 + 1.5) / 4)
    assert out.stats["tbpo/ratio_mean"] == pytest.approx(1.0)


def test_weighting_off_keeps_the_band_as_a_filter():
    out = TBPOLoss(weight_by_mismatch=False, **WIDE)(**_band_batch())
    assert out.loss.item() == pytest.approx((-1.0 + 2.0) / 2)
    assert out.stats["tbpo/kept_frac"] == pytest.approx(0.5)


def test_wider_band_keeps_everything():
    out = TBPOLoss(band_low=0.0, band_high=math.inf, **WIDE)(**_band_batch())
    # all 4 non-empty sequences, weighted: (-1*1 - 5*0.4 - 7*3 + 2*1.5) / 4
    assert out.loss.item() == pytest.approx((-1.0 - 2.0 - 21.0 + 3.0) / 4)
    assert out.stats["tbpo/kept_frac"] == 1.0


def test_all_dropped_gives_zero_loss_in_graph_and_finite_stats():
    batch = _batch([1.5, 0.7], [1.0, -1.0], mismatches=[0.1, 10.0])
    out = TBPOLoss(**WIDE)(**batch)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.equal(batch["logprobs"].grad, torch.zeros_like(batch["logprobs"]))
    assert out.stats["tbpo/kept_frac"] == 0.0
    assert out.stats["tbpo/drop_low_frac"] == pytest.approx(0.5)
    assert out.stats["tbpo/drop_high_frac"] == pytest.approx(0.5)
    assert out.stats["tbpo/ratio_mean"] == 0.0
    assert out.stats["tbpo/clipfrac"] == 0.0
    assert all(math.isfinite(v) for v in out.stats.values())


def test_empty_mask_is_finite_and_differentiable():
    batch = _batch([1.0, 1.0], [1.0, -1.0], mismatches=[1.0, 1.0])
    batch["mask"][:] = False
    out = TBPOLoss()(**batch)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.equal(batch["logprobs"].grad, torch.zeros_like(batch["logprobs"]))
    assert out.stats["tbpo/mismatch_mean"] == 0.0
    assert all(math.isfinite(v) for v in out.stats.values())


def test_gradient_of_a_tiny_case_matches_the_hand_derivation():
    # seq0: 2 valid tokens, log-ratios [0.1, -0.3] -> r0 = e^-0.1 (inside [0.8, 1.2]), A=2, m0 = 1.5.
    #   L0 = -A m0 r0, dL0/dlogp_t = -A m0 r0 * (1/2) for each valid token.
    # seq1: r1 = 1.5 clipped high with A=+1 -> constant, zero gradient.
    # loss = (L0 + L1) / 2, so grad(seq0 tokens) = -2 * 1.5 * e^-0.1 / 2 / 2; padding gets 0.
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, 0.0]], dtype=F64)
    logp = torch.tensor([[-0.9, -2.3, NAN], [-1.0 + math.log(1.5), -1.0 + math.log(1.5), NAN]], dtype=F64)
    logp.requires_grad_(True)
    roll = old - torch.tensor([[math.log(1.5)], [0.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.tensor([2.0, 1.0], dtype=F64)
    out = TBPOLoss(**WIDE)(logp, old, adv, mask, rollout_logprobs=roll)
    assert out.loss.item() == pytest.approx((-2.0 * 1.5 * math.exp(-0.1) - 1.2) / 2)
    out.loss.backward()
    g = -2.0 * 1.5 * math.exp(-0.1) / 2 / 2
    expected = torch.tensor([[g, g, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(logp.grad, expected)


def test_mismatch_weight_is_detached():
    batch = _band_batch()
    batch["rollout_logprobs"].requires_grad_(True)
    old = batch["old_logprobs"].clone().requires_grad_(True)
    batch["old_logprobs"] = old
    TBPOLoss(**WIDE)(**batch).loss.backward()
    assert old.grad is None and batch["rollout_logprobs"].grad is None
    assert batch["logprobs"].grad is not None


def test_one_token_sequences_match_grpo_token_loss():
    # With one valid token per sequence and m = 1, TBPO is token-level PPO with dual clip (GRPOLoss).
    r = torch.tensor([[0.5], [1.1], [1.6], [4.0], [0.3]], dtype=F64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5, -1.0], dtype=F64)
    mask = torch.ones(5, 1, dtype=torch.bool)
    old = torch.full((5, 1), -1.0, dtype=F64)
    kwargs = dict(epsilon_low=0.1, epsilon_high=0.3, dual_clip=2.5)
    tbpo = TBPOLoss(**kwargs)(old + r.log(), old, adv, mask)
    grpo = GRPOLoss(**kwargs)(old + r.log(), old, adv, mask)
    assert tbpo.loss.item() == pytest.approx(grpo.loss.item())
    assert tbpo.stats["tbpo/clipfrac"] == pytest.approx(grpo.stats["loss/pg_clipfrac"])
    assert tbpo.stats["tbpo/dual_clipfrac"] == pytest.approx(grpo.stats["loss/pg_clipfrac_lower"])


def test_token_advantages_are_averaged_per_sequence():
    batch = _batch([1.1, 0.5], [1.0, -1.0])
    per_seq = TBPOLoss(**WIDE)(**batch).loss.item()
    batch["advantages"] = torch.tensor([[0.5, 1.5, NAN], [-1.0, -1.0, NAN]], dtype=F64)  # means 1, -1
    assert TBPOLoss(**WIDE)(**batch).loss.item() == pytest.approx(per_seq)


def test_denominator_replaces_the_kept_count():
    out = TBPOLoss(**WIDE)(**_band_batch(), denominator=4)
    assert out.loss.item() == pytest.approx((-1.0 + 3.0) / 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(epsilon_low=-0.1), "epsilon_low"),
        (dict(epsilon_high=math.inf), "epsilon_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(band_low=1.5), "band_low"),
        (dict(band_low=-0.1), "band_low"),
        (dict(band_high=0.9), "band_high"),
        (dict(band_high=NAN), "band_high"),
        (dict(weight_by_mismatch=1), "weight_by_mismatch"),
    ],
)
def test_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TBPOLoss(**kwargs)


def test_forward_validation_names_the_argument():
    loss = TBPOLoss()
    good = _batch([1.0, 1.0], [1.0, -1.0], mismatches=[1.0, 1.0])
    cases = [
        ("mask", dict(mask=good["mask"].long())),
        ("rollout_logprobs", dict(rollout_logprobs=good["rollout_logprobs"][:, :2])),
        ("old_logprobs", dict(old_logprobs=torch.full_like(good["old_logprobs"], NAN))),
        ("advantages", dict(advantages=torch.ones(3, dtype=F64))),
        ("advantages", dict(advantages=torch.tensor([1.0, NAN], dtype=F64))),
        ("logprobs", dict(logprobs=torch.zeros(2, 3, dtype=torch.long))),
        ("denominator", dict(denominator=0)),
    ]
    for match, override in cases:
        with pytest.raises(ValueError, match=match):
            loss(**{**good, **override})
