"""Hypothesis properties that hold for any input (random shapes, mismatch sizes, masks, options)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ais_lightning.correctors import MIS, TIS, AISv1, NoCorrection

SETTINGS = settings(max_examples=60, deadline=None)

seeds = st.integers(0, 2**31 - 1)
batches = st.integers(1, 4)
lengths = st.integers(1, 7)
scales = st.sampled_from([0.0, 0.01, 0.3, 1.0, 3.0, 40.0])  # 40: log-ratios beyond the +-20 clamp
levels = st.sampled_from(["token", "sequence", "geometric"])
c_highs = st.floats(1.0, 5.0)
c_lows = st.one_of(st.none(), st.floats(0.0, 1.0))


@st.composite
def correctors(draw):
    """Any corrector with any valid options."""
    kind = draw(st.sampled_from(["none", "tis", "mis", "ais"]))
    if kind == "none":
        return NoCorrection()
    if kind == "tis":
        return TIS(level=draw(levels), c_high=draw(c_highs), c_low=draw(c_lows))
    if kind == "mis":
        veto = draw(st.one_of(st.none(), st.floats(1e-6, 1.0)))
        return MIS(level=draw(levels), c_low=draw(st.floats(0.0, 1.0)), c_high=draw(c_highs), veto=veto)
    return AISv1(**draw(ais_kwargs()))


@st.composite
def ais_kwargs(draw):
    lo = draw(st.floats(0.0, 1.0))
    hi = draw(st.floats(lo, 1.0))
    return dict(
        c=draw(c_highs),
        kappa=draw(st.floats(0.01, 10.0)),
        alpha=draw(st.floats(0.0, 3.0)),
        beta=draw(st.floats(0.0, 3.0)),
        lambda_min=lo,
        lambda_max=hi,
        use_reliability=draw(st.booleans()),
        use_severity=draw(st.booleans()),
        use_variance=draw(st.booleans()),
        ema_decay=draw(st.one_of(st.none(), st.floats(0.0, 0.99))),
    )


def extras(draw_flags, adv, ent):
    """Pass advantages / entropy or not."""
    use_adv, use_ent = draw_flags
    return {"advantages": adv if use_adv else None, "entropy": ent if use_ent else None}


@SETTINGS
@given(seeds, batches, lengths, scales, levels, c_highs, c_lows)
def test_tis_weights_never_exceed_c_high(make_random_inputs, seed, b, t, scale, level, c_high, c_low):
    train, rollout, mask, _, _ = make_random_inputs(seed, b, t, scale)
    out = TIS(level=level, c_high=c_high, c_low=c_low)(train, rollout, mask)
    assert bool((out.weights <= torch.tensor(c_high, dtype=torch.float32)).all())
    if c_low is not None:
        assert bool((out.weights[mask] >= torch.tensor(c_low, dtype=torch.float32)).all())


@SETTINGS
@given(seeds, batches, lengths, scales, correctors(), st.tuples(st.booleans(), st.booleans()))
def test_masked_tokens_get_zero_weight(make_random_inputs, seed, b, t, scale, corrector, flags):
    train, rollout, mask, adv, ent = make_random_inputs(seed, b, t, scale)
    train = torch.where(mask, train, torch.full_like(train, float("nan")))  # garbage on padding
    out = corrector(train, rollout, mask, **extras(flags, adv, ent))
    assert out.weights.shape == mask.shape and out.weights.dtype == torch.float32
    assert bool((out.weights[~out.mask] == 0).all())
    assert bool((out.weights[~mask] == 0).all())
    assert not bool((out.mask & ~mask).any()), "out.mask must be a subset of mask"
    assert bool(torch.isfinite(out.weights).all())
    assert all(math.isfinite(v) for v in out.stats.values())


@SETTINGS
@given(seeds, batches, lengths, correctors(), st.tuples(st.booleans(), st.booleans()))
def test_on_policy_gives_unit_weights(make_random_inputs, seed, b, t, corrector, flags):
    _, rollout, mask, adv, ent = make_random_inputs(seed, b, t, 0.0)
    out = corrector(rollout.clone(), rollout, mask, **extras(flags, adv, ent))
    assert torch.equal(out.mask, mask)
    torch.testing.assert_close(out.weights[mask], torch.ones(int(mask.sum())), atol=1e-6, rtol=0)
    assert out.stats["corrector/clipped_frac"] == 0.0
    assert out.stats["corrector/masked_frac"] == 0.0
    if isinstance(corrector, AISv1):
        assert out.stats["ais/severity"] == 0.0
        if corrector.coefficient_kwargs["use_severity"]:  # s = 0 makes lambda_raw = 0
            assert out.stats["ais/lambda"] == corrector.coefficient_kwargs["lambda_min"]


@SETTINGS
@given(seeds, batches, lengths, st.tuples(st.booleans(), st.booleans()))
def test_on_policy_ais_lambda_is_zero(make_random_inputs, seed, b, t, flags):
    _, rollout, mask, adv, ent = make_random_inputs(seed, b, t, 0.0)
    out = AISv1()(rollout.clone(), rollout, mask, **extras(flags, adv, ent))
    assert out.stats["ais/lambda"] == 0.0


@SETTINGS
@given(seeds, batches, lengths, scales, c_highs, st.tuples(st.booleans(), st.booleans()))
def test_ais_limits_equal_none_and_token_tis(make_random_inputs, seed, b, t, scale, c, flags):
    train, rollout, mask, adv, ent = make_random_inputs(seed, b, t, scale)
    kw = extras(flags, adv, ent)
    for fixed, reference in ((0.0, NoCorrection()), (1.0, TIS(level="token", c_high=c))):
        ais_out = AISv1(c=c, fixed_lambda=fixed)(train, rollout, mask, **kw)
        ref_out = reference(train, rollout, mask, **kw)
        assert torch.equal(ais_out.weights, ref_out.weights)
        assert torch.equal(ais_out.mask, ref_out.mask)
        assert {k: ais_out.stats[k] for k in ref_out.stats} == ref_out.stats


@SETTINGS
@given(seeds, batches, lengths, scales, ais_kwargs(), st.tuples(st.booleans(), st.booleans()))
def test_lambda_in_unit_interval(make_random_inputs, seed, b, t, scale, kwargs, flags):
    train, rollout, mask, adv, ent = make_random_inputs(seed, b, t, scale)
    ais = AISv1(**kwargs)
    for _ in range(2):  # the second call goes through the EMA when enabled
        out = ais(train, rollout, mask, **extras(flags, adv, ent))
        lam = out.stats["ais/lambda"]
        assert 0.0 <= lam <= 1.0
        assert kwargs["lambda_min"] - 1e-12 <= lam <= kwargs["lambda_max"] + 1e-12
        for key in ("ais/reliability", "ais/severity", "ais/variance_factor"):
            assert 0.0 <= out.stats[key] <= 1.0, key
        # Weights are a convex mix of 1 and w_C: between min(1, w_C) and max(1, w_C).
        w_c = torch.exp((train - rollout).clamp(-20, 20)).clamp(max=kwargs["c"])[mask]
        lo = torch.minimum(w_c, torch.ones_like(w_c)) - 1e-5
        hi = torch.maximum(w_c, torch.ones_like(w_c)) + 1e-5
        assert bool(((out.weights[mask] >= lo) & (out.weights[mask] <= hi)).all())
