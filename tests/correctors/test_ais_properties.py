"""Hypothesis properties of AIS v2 that hold for any input (shapes, mismatch sizes, masks, options)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ais_lightning.correctors import AIS, MIS, TIS, NoCorrection
from ais_lightning.diagnostics import AISCoefficient

SETTINGS = settings(max_examples=60, deadline=None)

seeds = st.integers(0, 2**31 - 1)
batches = st.integers(1, 5)
lengths = st.integers(1, 7)
scales = st.sampled_from([0.0, 0.01, 0.3, 1.0, 3.0, 40.0])  # 40: log-ratios beyond the +-20 clamp
flags = st.tuples(st.booleans(), st.booleans())


@st.composite
def ais_kwargs(draw):
    lo = draw(st.floats(0.0, 1.0))
    base = draw(st.sampled_from(["tis", "mis"]))
    return dict(
        c=draw(st.floats(1.0, 5.0)),
        base=base,
        c_low=draw(st.one_of(st.none(), st.floats(0.0, 1.0))),
        noise_to_signal=draw(st.sampled_from([0.0, 0.1, 1.0, 10.0])),
        use_entropy=draw(st.booleans()),
        use_reliability=draw(st.booleans()),
        lambda_min=lo,
        lambda_max=draw(st.floats(lo, 1.0)),
        ema_decay=draw(st.one_of(st.none(), st.floats(0.0, 0.99))),
    )


def extras(use, adv, ent):
    use_adv, use_ent = use
    return {"advantages": adv if use_adv else None, "entropy": ent if use_ent else None}


def base_weight(train, rollout, kwargs):
    """b_t recomputed independently of the corrector (float32, like the corrector)."""
    w = torch.exp((train - rollout).clamp(-20, 20))
    c, lo = kwargs["c"], kwargs["c_low"]
    if kwargs["base"] == "tis":
        return w.clamp(min=lo, max=c)
    lo = 1.0 / c if lo is None else lo
    return torch.where((w >= lo) & (w <= c), w, torch.zeros_like(w))


@SETTINGS
@given(seeds, batches, lengths, scales, ais_kwargs(), flags)
def test_lambda_in_range_and_weights_between_the_two_ends(make_random_inputs, seed, b, t, scale, kwargs, use):
    train, rollout, mask, adv, ent = make_random_inputs(seed, b, t, scale)
    ais = AIS(**kwargs)
    for _ in range(2):  # the second call goes through the EMA when enabled
        out = ais(train, rollout, mask, **extras(use, adv, ent))
        lam = out.stats["ais/lambda"]
        assert 0.0 <= lam <= 1.0
        assert kwargs["lambda_min"] - 1e-12 <= lam <= kwargs["lambda_max"] + 1e-12
        assert all(math.isfinite(v) for v in out.stats.values())
        assert 0.0 <= out.stats["ais/reliability"] <= 1.0
        assert 0.0 <= out.stats["ais/lambda_raw"] <= 1.0
        assert out.stats["ais/severity"] >= 0.0 and out.stats["ais/variance_amplification"] >= 1.0
        assert 0.0 < out.stats["ais/spread"] <= 1.0
        # Weights are a convex mix of 1 and b_t, and nothing leaves the mask.
        b_t = base_weight(train, rollout, kwargs)[mask]
        lo = torch.minimum(b_t, torch.ones_like(b_t)) - 1e-5
        hi = torch.maximum(b_t, torch.ones_like(b_t)) + 1e-5
        assert bool(((out.weights[mask] >= lo) & (out.weights[mask] <= hi)).all())
        assert torch.equal(out.mask, mask) and bool((out.weights[~mask] == 0).all())


@SETTINGS
@given(seeds, batches, lengths, flags)
def test_on_policy_lambda_is_zero(make_random_inputs, seed, b, t, use):
    _, rollout, mask, adv, ent = make_random_inputs(seed, b, t, 0.0)
    out = AIS()(rollout.clone(), rollout, mask, **extras(use, adv, ent))
    assert out.stats["ais/lambda"] == 0.0
    torch.testing.assert_close(out.weights[mask], torch.ones(int(mask.sum())), atol=1e-6, rtol=0)


@SETTINGS
@given(seeds, batches, lengths, scales, st.floats(1.0, 5.0), flags)
def test_limits_equal_none_and_the_base_correctors(make_random_inputs, seed, b, t, scale, c, use):
    train, rollout, mask, adv, ent = make_random_inputs(seed, b, t, scale)
    kw = extras(use, adv, ent)
    pairs = (
        (AIS(c=c, fixed_lambda=0.0), NoCorrection()),
        (AIS(c=c, fixed_lambda=1.0), TIS(level="token", c_high=c)),
    )
    for ais, reference in pairs:
        got, want = ais(train, rollout, mask, **kw), reference(train, rollout, mask, **kw)
        assert torch.equal(got.weights, want.weights) and torch.equal(got.mask, want.mask)
    got = AIS(c=c, base="mis", fixed_lambda=1.0)(train, rollout, mask, **kw)
    want = MIS(level="token", c_low=1.0 / c, c_high=c)(train, rollout, mask, **kw)
    assert torch.equal(got.weights, torch.where(want.mask, want.weights, torch.zeros_like(want.weights)))


@SETTINGS
@given(seeds, batches, lengths, scales, flags)
def test_more_gradient_noise_never_means_more_correction(make_random_inputs, seed, b, t, scale, use):
    train, rollout, mask, adv, ent = make_random_inputs(seed, b, t, scale)
    kw = extras(use, adv, ent)
    lams = [
        AIS(noise_to_signal=phi)(train, rollout, mask, **kw).stats["ais/lambda"] for phi in (0.0, 0.1, 1, 10)
    ]
    assert all(x >= y - 1e-12 for x, y in zip(lams, lams[1:]))


@SETTINGS
@given(seeds, st.integers(1, 3), st.integers(1, 3), lengths, scales, ais_kwargs(), flags)
def test_metric_over_batches_equals_the_corrector_on_their_union(
    make_random_inputs, seed, b1, b2, t, scale, kwargs, use
):
    first = make_random_inputs(seed, b1, t, scale)
    second = make_random_inputs(seed + 1, b2, t, scale)
    kwargs = {**kwargs, "ema_decay": None}
    metric = AISCoefficient("lambda", params=AIS(**kwargs).params)
    for train, rollout, mask, adv, ent in (first, second):
        metric.update(train, rollout, mask, **extras(use, adv, ent))
    train, rollout, mask, adv, ent = (torch.cat([x, y]) for x, y in zip(first, second))
    out = AIS(**kwargs)(train, rollout, mask, **extras(use, adv, ent))
    assert float(metric.compute()) == out.stats["ais/lambda"] or math.isclose(
        float(metric.compute()), out.stats["ais/lambda"], rel_tol=1e-9, abs_tol=1e-12
    )
