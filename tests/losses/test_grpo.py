"""Tests for ais_lightning.losses.GRPOLoss: hand-derived values for every branch and aggregation."""

import math

import pytest
import torch

from ais_lightning.losses import GRPOLoss, LossOutput

F64 = torch.float64


def _inputs(ratios, advantages, mask=None):
    """logprobs = log(ratio) with grad, old_logprobs = 0, so exp(logprobs - old) = ratio."""
    r = torch.tensor([ratios], dtype=F64)
    logprobs = r.log().requires_grad_(True)
    old = torch.zeros_like(r)
    adv = torch.tensor([advantages], dtype=F64)
    mask = torch.ones_like(r, dtype=torch.bool) if mask is None else torch.tensor([mask])
    return logprobs, old, adv, mask


def test_symmetric_clip_both_sides_hand_values():
    # eps = 0.2, per token -min(rA, clip(r, 0.8, 1.2) A):
    #  A=+1 r=1.5 -> -1.2 (upper clip)   A=+1 r=0.5 -> -0.5
    #  A=-1 r=0.5 -> +0.8 (lower clip)   A=-1 r=1.5 -> +1.5
    logprobs, old, adv, mask = _inputs([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0])
    out = GRPOLoss(epsilon_high=0.2)(logprobs, old, adv, mask)  # symmetric: both clips at 0.2
    assert isinstance(out, LossOutput)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5) / 4)
    assert out.stats["loss/pg_clipfrac"] == pytest.approx(0.5)
    assert out.stats["loss/pg_clipfrac_lower"] == 0.0
    assert out.stats["loss/ratio_mean"] == pytest.approx(1.0)
    assert out.stats["loss/ratio_max"] == pytest.approx(1.5)
    assert out.stats["loss/pg_loss"] == pytest.approx(0.15)
    assert out.stats["loss/total"] == pytest.approx(0.15)
    assert all(isinstance(v, float) for v in out.stats.values())


def test_asymmetric_clip_hand_values():
    # clip range [0.9, 1.3]:
    #  A=+1 r=1.25 -> -1.25 (inside)     A=+1 r=2.0 -> -1.3 (upper clip)
    #  A=-1 r=0.85 -> +0.9 (lower clip)  A=-1 r=0.95 -> +0.95 (inside)
    logprobs, old, adv, mask = _inputs([1.25, 2.0, 0.85, 0.95], [1.0, 1.0, -1.0, -1.0])
    out = GRPOLoss(epsilon_low=0.1, epsilon_high=0.3)(logprobs, old, adv, mask)
    assert out.loss.item() == pytest.approx((-1.25 - 1.3 + 0.9 + 0.95) / 4)
    assert out.stats["loss/pg_clipfrac"] == pytest.approx(0.5)


def test_dual_clip_hand_values():
    # eps 0.2, dual_clip 3:
    #  A=-1 r=5 -> PPO 5,  dual min(5, 3) = 3 (active)
    #  A=-1 r=2 -> PPO 2,  dual min(2, 3) = 2
    #  A=+1 r=5 -> -1.2 (upper clip, dual clip never applies to A > 0)
    #  A=-2 r=4 -> PPO 8,  dual min(8, 6) = 6 (active)
    logprobs, old, adv, mask = _inputs([5.0, 2.0, 5.0, 4.0], [-1.0, -1.0, 1.0, -2.0])
    out = GRPOLoss(epsilon_high=0.2, dual_clip=3.0)(logprobs, old, adv, mask)
    assert out.loss.item() == pytest.approx((3.0 + 2.0 - 1.2 + 6.0) / 4)
    assert out.stats["loss/pg_clipfrac_lower"] == pytest.approx(0.5)
    assert out.stats["loss/pg_clipfrac"] == pytest.approx(0.25)
    plain = GRPOLoss(epsilon_high=0.2)(logprobs, old, adv, mask)
    assert plain.loss.item() == pytest.approx((5.0 + 2.0 - 1.2 + 8.0) / 4)


def test_weights_multiply_after_clipping():
    # A=+1 r=1.5 w=0.5: after clip -1.2 * 0.5 = -0.6 (weight inside the ratio would give -0.75)
    # A=-1 r=0.5 w=2:   after clip  0.8 * 2   =  1.6 (weight inside the ratio would give 1.0)
    logprobs, old, adv, mask = _inputs([1.5, 0.5], [1.0, -1.0])
    weights = torch.tensor([[0.5, 2.0]], dtype=F64)
    out = GRPOLoss(epsilon_high=0.2)(logprobs, old, adv, mask, weights=weights)
    assert out.loss.item() == pytest.approx((-0.6 + 1.6) / 2)
    assert out.stats["loss/pg_clipfrac"] == pytest.approx(1.0)  # clipping judged on the raw ratio


def _aggregation_batch():
    # ratio 1 everywhere, so pg = -A on valid tokens. Row 2 has no valid token (fully rejected).
    # Masked positions hold -inf / NaN padding that must not leak into loss or grads.
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    logprobs = torch.tensor(
        [[-0.5, -1.0, -math.inf], [-2.0, -math.inf, -math.inf], [-math.inf] * 3], dtype=F64
    )
    logprobs.requires_grad_(True)
    old = logprobs.detach().clone()
    adv = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 99.0, 99.0], [7.0, 7.0, 7.0]], dtype=F64)
    return logprobs, old, adv, mask


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token-mean", -(1.0 + 2.0 + 4.0) / 3),  # 3 valid tokens
        ("seq-mean-token-mean", (-1.5 - 4.0) / 2),  # row means -1.5, -4; the empty row leaves
        ("seq-mean-token-sum-norm", (-3.0 / 4 - 4.0 / 4 + 0.0) / 3),  # sums / L=4, mean over B=3
    ],
)
def test_aggregations_hand_values(aggregation, expected):
    logprobs, old, adv, mask = _aggregation_batch()
    loss_fn = GRPOLoss(aggregation=aggregation, max_response_length=4)
    out = loss_fn(logprobs, old, adv, mask)
    assert out.loss.item() == pytest.approx(expected)
    out.loss.backward()
    assert bool(torch.isfinite(logprobs.grad).all())
    assert bool((logprobs.grad[~mask] == 0).all())
    assert all(math.isfinite(v) for v in out.stats.values())


def test_kl_k3_and_entropy_bonus_hand_values():
    # logp = old = 0 and A = 1: pg = -1 per token, pg_loss = -1.
    # ref - logp = +ln2 -> k3 = 2 - ln2 - 1;  ref - logp = -ln2 -> k3 = 1/2 + ln2 - 1;  mean = 0.25
    # entropy [0.5, 1.5] -> mean 1.0
    logprobs = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    adv = torch.ones(1, dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    ref = torch.tensor([[math.log(2.0), -math.log(2.0)]], dtype=F64)
    entropy = torch.tensor([[0.5, 1.5]], dtype=F64, requires_grad=True)
    out = GRPOLoss(kl_coef=0.1, entropy_coef=0.01)(
        logprobs, old, adv, mask, ref_logprobs=ref, entropy=entropy
    )
    assert out.stats["loss/pg_loss"] == pytest.approx(-1.0)
    assert out.stats["loss/kl"] == pytest.approx(0.25)
    assert out.stats["loss/entropy"] == pytest.approx(1.0)
    assert out.loss.item() == pytest.approx(-1.0 + 0.1 * 0.25 - 0.01 * 1.0)
    assert out.stats["loss/total"] == pytest.approx(out.loss.item())
    out.loss.backward()
    torch.testing.assert_close(entropy.grad, torch.full((1, 2), -0.01 / 2, dtype=F64))


def test_kl_and_entropy_logged_but_not_added_with_zero_coef():
    logprobs, old, adv, mask = _inputs([1.0, 1.0], [1.0, 1.0])
    ref = torch.full((1, 2), math.log(2.0), dtype=F64)
    entropy = torch.ones(1, 2, dtype=F64, requires_grad=True)
    out = GRPOLoss()(logprobs, old, adv, mask, ref_logprobs=ref, entropy=entropy)
    assert out.loss.item() == pytest.approx(-1.0)
    assert out.stats["loss/kl"] == pytest.approx(1.0 - math.log(2.0))
    assert torch.autograd.grad(out.loss, entropy, allow_unused=True) == (None,)


def test_gradient_matches_hand_derivation():
    # token-mean over N = 4 valid tokens, kl_coef = 0.1, ref - logp = ln2 on every token.
    # d/dlogp of -A r w / N is -A r w / N on unclipped tokens, 0 on clipped and dual-clipped ones;
    # d/dlogp of k3 = exp(ref - logp) - (ref - logp) - 1 is 1 - exp(ref - logp) = -1, times 0.1 / 4.
    logprobs, old, adv, mask = _inputs(
        [1.1, 1.5, 5.0, 0.9, 1.0], [1.0, 1.0, -1.0, -1.0, 3.0], [True, True, True, True, False]
    )
    weights = torch.tensor([[0.5, 1.0, 1.0, 2.0, 1.0]], dtype=F64)
    ref = logprobs.detach() + math.log(2.0)
    out = GRPOLoss(dual_clip=3.0, kl_coef=0.1)(logprobs, old, adv, mask, weights=weights, ref_logprobs=ref)
    out.loss.backward()
    kl = 0.1 * (1.0 - 2.0) / 4
    expected = torch.tensor([[-1.1 * 0.5 / 4 + kl, kl, kl, 0.9 * 2.0 / 4 + kl, 0.0]], dtype=F64)
    torch.testing.assert_close(logprobs.grad, expected)


def test_gradcheck_finite_differences():
    # Away from the clip kinks the analytical gradient must match finite differences.
    torch.manual_seed(0)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    old = torch.randn(2, 4, dtype=F64)
    logprobs = (old + 0.3 * torch.randn(2, 4, dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5], dtype=F64)
    weights = torch.rand(2, 4, dtype=F64) + 0.5
    ref = old - 0.2
    entropy = torch.rand(2, 4, dtype=F64).requires_grad_(True)
    loss_fn = GRPOLoss(
        epsilon_low=0.3,
        epsilon_high=0.3,
        dual_clip=3.0,
        kl_coef=0.2,
        entropy_coef=0.05,
        aggregation="seq-mean-token-mean",
    )

    def f(lp, ent):
        return loss_fn(lp, old, adv, mask, weights=weights, ref_logprobs=ref, entropy=ent).loss

    assert torch.autograd.gradcheck(f, (logprobs, entropy))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_denominator_override_sums_micro_batches_to_full_batch(aggregation):
    torch.manual_seed(1)
    B, T = 6, 5
    mask = torch.rand(B, T) < 0.7
    mask[2] = False  # a fully rejected sequence
    old = -torch.rand(B, T, dtype=F64) * 3
    logprobs = (old + 0.5 * torch.randn(B, T, dtype=F64)).requires_grad_(True)  # clips happen
    adv = torch.randn(B, dtype=F64)
    weights = torch.rand(B, T, dtype=F64) * 2
    loss_fn = GRPOLoss(dual_clip=3.0, aggregation=aggregation, max_response_length=T)

    full = loss_fn(logprobs, old, adv, mask, weights=weights).loss
    (full_grad,) = torch.autograd.grad(full, logprobs)
    if aggregation == "token-mean":
        denominator = int(mask.sum())
    elif aggregation == "seq-mean-token-mean":
        denominator = int(mask.any(dim=-1).sum())
    else:
        denominator = B
    micro = sum(
        loss_fn(logprobs[s], old[s], adv[s], mask[s], weights=weights[s], denominator=denominator).loss
        for s in (slice(0, 2), slice(2, 3), slice(3, 6))
    )
    (micro_grad,) = torch.autograd.grad(micro, logprobs)
    torch.testing.assert_close(micro, full)
    torch.testing.assert_close(micro_grad, full_grad)
    # without the override each micro-batch is its own mean, so the sum differs
    naive = sum(
        loss_fn(logprobs[s], old[s], adv[s], mask[s], weights=weights[s]).loss
        for s in (slice(0, 3), slice(3, 6))
    )
    assert not torch.allclose(naive, full)


def test_bypass_equals_decoupled_with_pi_old_equal_mu_and_unit_weights():
    torch.manual_seed(2)
    mask = torch.rand(3, 4) < 0.8
    mu = -torch.rand(3, 4, dtype=F64) * 2
    logprobs = (mu + 0.4 * torch.randn(3, 4, dtype=F64)).requires_grad_(True)
    adv = torch.randn(3, dtype=F64)
    bypass = GRPOLoss(mode="bypass", dual_clip=2.0)(logprobs, mu, adv, mask)
    decoupled = GRPOLoss(mode="decoupled", dual_clip=2.0)(
        logprobs, mu, adv, mask, weights=torch.ones(3, 4, dtype=F64)
    )
    torch.testing.assert_close(bypass.loss, decoupled.loss)
    assert bypass.stats == pytest.approx(decoupled.stats)
    # NoCorrection's identity weights are accepted (one call signature for every loss), and mu may come
    # as rollout_logprobs; real IS weights are refused: the ratio pi_theta/mu already is the IS ratio.
    ones = GRPOLoss(mode="bypass", dual_clip=2.0)(
        logprobs, mu + 1.0, adv, mask, weights=mask.to(F64), rollout_logprobs=mu
    )
    torch.testing.assert_close(ones.loss, bypass.loss)
    with pytest.raises(ValueError, match="weights"):
        GRPOLoss(mode="bypass")(logprobs, mu, adv, mask, weights=torch.full((3, 4), 2.0, dtype=F64))


def test_no_valid_tokens_gives_connected_zero_loss_and_finite_stats():
    logprobs = torch.randn(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        out = GRPOLoss(aggregation=aggregation, max_response_length=3, kl_coef=0.1)(
            logprobs, torch.randn(2, 3), torch.ones(2), mask, ref_logprobs=torch.randn(2, 3)
        )
        assert out.loss.item() == 0.0
        assert out.loss.requires_grad
        (grad,) = torch.autograd.grad(out.loss, logprobs)
        assert bool((grad == 0).all())
        assert all(math.isfinite(v) for v in out.stats.values())


def test_old_logprobs_get_no_grad():
    logprobs, _, adv, mask = _inputs([1.5, 0.5], [1.0, -1.0])
    old = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    out = GRPOLoss()(logprobs, old, adv, mask)
    out.loss.backward()
    assert old.grad is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon_low": -0.1}, "epsilon_low"),
        ({"epsilon_low": 1.5}, "epsilon_low"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"entropy_coef": -1.0}, "entropy_coef"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"aggregation": "seq-mean-token-sum-norm"}, "max_response_length"),
        ({"max_response_length": 0}, "max_response_length"),
        ({"mode": "on-policy"}, "mode"),
    ],
)
def test_bad_constructor_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOLoss(**kwargs)


def _bad_forward_cases():
    lp = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    nan = torch.zeros(2, 3)
    nan[0, 0] = float("nan")
    return (
        [
            ({"logprobs": torch.zeros(2, 4)}, "logprobs"),
            ({"logprobs": nan}, "logprobs"),
            ({"old_logprobs": torch.zeros(3, 3)}, "old_logprobs"),
            ({"mask": mask.float()}, "mask"),
            ({"advantages": torch.zeros(3)}, "advantages"),
            ({"advantages": torch.zeros(2, 4)}, "advantages"),
            ({"advantages": nan}, "advantages"),
            ({"weights": -torch.ones(2, 3)}, "weights"),
            ({"weights": torch.ones(2, 2)}, "weights"),
            ({"ref_logprobs": nan}, "ref_logprobs"),
            ({"entropy": torch.zeros(2, 3, dtype=torch.long)}, "entropy"),
            ({"denominator": 0}, "denominator"),
        ],
        lp,
        mask,
    )


def test_bad_forward_inputs_name_the_tensor():
    cases, lp, mask = _bad_forward_cases()
    for override, match in cases:
        args = {"logprobs": lp, "old_logprobs": lp, "advantages": torch.zeros(2), "mask": mask} | override
        with pytest.raises(ValueError, match=match):
            GRPOLoss()(**args)


def test_coefficients_require_their_tensors():
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="ref_logprobs"):
        GRPOLoss(kl_coef=0.1)(lp, lp, torch.zeros(2), mask)
    with pytest.raises(ValueError, match="entropy"):
        GRPOLoss(entropy_coef=0.1)(lp, lp, torch.zeros(2), mask)


def test_prime_rl_mismatch_penalty_adds_coef_times_mean_squared_log_ratio():
    # ratio 1 to pi_old and A = 0 -> pg = 0; log pi - log mu = [0.5, -1.0] -> mean square (0.25 + 1) / 2.
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    mu = torch.tensor([[-1.5, -1.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.zeros(1, dtype=F64)
    out = GRPOLoss(mismatch_penalty_coef=1e-3)(logprobs, logprobs.detach(), adv, mask, rollout_logprobs=mu)
    assert out.stats["loss/mismatch_penalty"] == pytest.approx(0.625)
    assert out.loss.item() == pytest.approx(1e-3 * 0.625)
    out.loss.backward()  # d/dlogp 1e-3 * mean((logp - mu)^2) = 1e-3 * (logp - mu)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.5e-3, -1.0e-3]], dtype=F64))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        GRPOLoss(mismatch_penalty_coef=1e-3)(logprobs, logprobs.detach(), adv, mask)
