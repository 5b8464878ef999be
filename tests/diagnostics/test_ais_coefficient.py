"""AISCoefficient: accumulated over batches it equals the AIS corrector on their concatenation."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.correctors import AIS
from ais_lightning.diagnostics.ais_coefficient import AIS_COMPONENTS, AISCoefficient

STAT_KEY = {
    "lambda": "ais/lambda",
    "reliability": "ais/reliability",
    "severity": "ais/severity",
    "variance_factor": "ais/variance_factor",
}


def batch(seed: int, b: int, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g) * 4.0 - 0.05
    train = rollout + 0.4 * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    advantages = torch.randn(b, generator=g)
    entropy = torch.rand(b, t, generator=g) * 2.0
    return train, rollout, mask, advantages, entropy


@pytest.mark.parametrize("component", AIS_COMPONENTS)
@pytest.mark.parametrize("with_extras", [False, True])
def test_two_batches_equal_ais_on_the_concatenation(component, with_extras):
    kwargs = dict(c=1.5, kappa=0.5, alpha=1.5, beta=0.7)
    first, second = batch(0, 3), batch(1, 5)
    metric = AISCoefficient(component=component, **kwargs)
    for train, rollout, mask, adv, ent in (first, second):
        metric.update(train, rollout, mask, **({"advantages": adv, "entropy": ent} if with_extras else {}))
    train, rollout, mask, adv, ent = (torch.cat([x, y]) for x, y in zip(first, second))
    out = AIS(**kwargs)(train, rollout, mask, **({"advantages": adv, "entropy": ent} if with_extras else {}))
    value = float(metric.compute())
    assert value == pytest.approx(out.stats[STAT_KEY[component]], rel=1e-9, abs=1e-12)
    assert 0.0 <= value <= 1.0


def test_values_differ_between_batches_so_the_test_above_can_fail():
    a, b = AISCoefficient(), AISCoefficient()
    a.update(*batch(0, 3)[:3])
    b.update(*batch(1, 5)[:3])
    assert float(a.compute()) != pytest.approx(float(b.compute()), rel=1e-3)


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_reset_empty_and_state():
    metric = AISCoefficient(component="severity")
    assert float(metric.compute()) == 0.0  # nothing seen: severity 0, no NaN
    metric.update(*batch(0, 2)[:3])
    assert float(metric.compute()) > 0.0
    metric.reset()
    assert float(metric.compute()) == 0.0
    assert metric.full_state_update is False
    assert metric._reductions["stats"] is not None


def test_bad_arguments():
    with pytest.raises(ValueError, match="component"):
        AISCoefficient(component="ess")
    with pytest.raises(ValueError, match="c must"):
        AISCoefficient(c=0.5)
    train, rollout, mask, _, _ = batch(0, 2)
    with pytest.raises(ValueError, match="mask"):
        AISCoefficient().update(train, rollout, mask.float())
