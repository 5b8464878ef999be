"""AISCoefficient (v2) and AISv1Coefficient: accumulated over batches they equal the corrector on the union."""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning import ops
from ais_lightning.correctors import AIS, AISv1, ais_params
from ais_lightning.correctors.ais_v1 import ais_v1_params
from ais_lightning.diagnostics import AISCoefficient
from ais_lightning.diagnostics.ais_coefficient import AIS_COMPONENTS, V1_COMPONENTS, AISv1Coefficient

V2_KWARGS = dict(c=1.5, noise_to_signal=0.5)
V1_KWARGS = dict(c=1.5, kappa=0.5, alpha=1.5, beta=0.7)


def batch(seed: int, b: int, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g) * 4.0 - 0.05
    train = rollout + 0.4 * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    advantages = torch.randn(b, generator=g)
    entropy = torch.rand(b, t, generator=g) * 2.0
    return train, rollout, mask, advantages, entropy


def two_batches_and_union(with_extras: bool):
    first, second = batch(0, 3), batch(1, 5)
    union = tuple(torch.cat([x, y]) for x, y in zip(first, second))

    def call(args):
        train, rollout, mask, adv, ent = args
        return (train, rollout, mask), ({"advantages": adv, "entropy": ent} if with_extras else {})

    return [call(first), call(second)], call(union)


@pytest.mark.parametrize("component", AIS_COMPONENTS)
@pytest.mark.parametrize("with_extras", [False, True])
def test_v2_two_batches_equal_ais_on_the_concatenation(component, with_extras):
    batches, (union, union_kw) = two_batches_and_union(with_extras)
    metric = AISCoefficient(component=component, params=ais_params(**V2_KWARGS))
    for args, kw in batches:
        metric.update(*args, **kw)
    out = AIS(**V2_KWARGS)(*union, **union_kw)
    value = float(metric.compute())
    assert value == pytest.approx(out.stats[f"ais/{component}"], rel=1e-9, abs=1e-12)
    assert math.isfinite(value)


@pytest.mark.parametrize("component", V1_COMPONENTS)
@pytest.mark.parametrize("with_extras", [False, True])
def test_v1_two_batches_equal_ais_v1_on_the_concatenation(component, with_extras):
    batches, (union, union_kw) = two_batches_and_union(with_extras)
    metric = AISv1Coefficient(component=component, params=ais_v1_params(**V1_KWARGS))
    for args, kw in batches:
        metric.update(*args, **kw)
    out = AISv1(**V1_KWARGS)(*union, **union_kw)
    value = float(metric.compute())
    assert value == pytest.approx(out.stats[f"ais/{component}"], rel=1e-9, abs=1e-12)
    assert 0.0 <= value <= 1.0


def test_default_metric_equals_the_default_corrector_and_accepts_a_precomputed_log_ratio():
    train, rollout, mask, adv, ent = batch(2, 16)
    plain, shared = AISCoefficient(), AISCoefficient()
    plain.update(train, rollout, mask, advantages=adv, entropy=ent)
    delta = ops.log_ratio(train, rollout, mask)
    nan = torch.full_like(train, float("nan"))  # garbage log-probs: only log_ratio is read
    shared.update(nan, nan, mask, advantages=adv, entropy=ent, log_ratio=delta)
    want = AIS()(train, rollout, mask, advantages=adv, entropy=ent).stats["ais/lambda"]
    assert 0.0 < want < 1.0
    assert float(plain.compute()) == pytest.approx(want, rel=1e-9)
    assert float(shared.compute()) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("spread", ["impurity", "entropy_bound"])
def test_v2_metric_reads_the_impurity_as_the_corrector_does(spread):
    """With an impurity the metric's lambda is the corrector's, for either spread; the two spreads differ."""
    train, rollout, mask, adv, ent = batch(3, 16)
    imp = torch.rand(train.shape, generator=torch.Generator().manual_seed(4)) * 0.3
    metric = AISCoefficient(params=ais_params(spread=spread))
    metric.update(train, rollout, mask, advantages=adv, entropy=ent, impurity=imp)
    out = AIS(spread=spread)(train, rollout, mask, advantages=adv, entropy=ent, impurity=imp)
    assert float(metric.compute()) == pytest.approx(out.stats["ais/lambda"], rel=1e-9)
    other = "entropy_bound" if spread == "impurity" else "impurity"
    lam_other = AIS(spread=other)(train, rollout, mask, advantages=adv, entropy=ent, impurity=imp).stats[
        "ais/lambda"
    ]
    assert lam_other != pytest.approx(out.stats["ais/lambda"], rel=1e-3)


def test_values_differ_between_batches_so_the_tests_above_can_fail():
    for cls in (AISCoefficient, AISv1Coefficient):
        a, b = cls(), cls()
        a.update(*batch(0, 3)[:3])
        b.update(*batch(1, 5)[:3])
        assert float(a.compute()) != pytest.approx(float(b.compute()), rel=1e-3), cls


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_reset_empty_and_state():
    metric = AISCoefficient(component="severity")
    assert float(metric.compute()) == 0.0  # nothing seen: beta 0, no NaN
    assert float(AISCoefficient().compute()) == 0.0
    metric.update(*batch(0, 2)[:3])
    assert float(metric.compute()) > 0.0
    metric.reset()
    assert float(metric.compute()) == 0.0
    assert metric.full_state_update is False
    assert metric._reductions["stats"] is not None


def test_bad_arguments():
    with pytest.raises(ValueError, match="^component"):
        AISCoefficient(component="ess")
    with pytest.raises(ValueError, match="^component"):
        AISv1Coefficient(component="bias_sq")
    with pytest.raises(ValueError, match="^params"):
        AISCoefficient(params=ais_v1_params())
    with pytest.raises(ValueError, match="^params"):
        AISv1Coefficient(params=ais_params())
    with pytest.raises(ValueError, match="^c must"):
        ais_params(c=0.5)
    train, rollout, mask, _, _ = batch(0, 2)
    with pytest.raises(ValueError, match="mask"):
        AISCoefficient().update(train, rollout, mask.float())
