"""RoutingDisagreement: fraction of (token, MoE layer) top-k sets that differ, overall and per layer."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.diagnostics import RoutingDisagreement


def test_counts_sets_not_order_over_valid_tokens_and_layers():
    engine = torch.tensor([[[[0, 1], [2, 3], [4, 5]], [[1, 2], [3, 4], [5, 6]]]])  # [1, 2, L=3, 2]
    trainer = torch.tensor([[[[1, 0], [2, 7], [4, 5]], [[0, 0], [0, 0], [0, 0]]]])
    mask = torch.tensor([[True, False]])  # token 1 does not count
    metrics = [RoutingDisagreement()] + [RoutingDisagreement(layer=i) for i in range(3)]
    for m in metrics:
        m.update(engine, trainer.to(torch.uint8), mask)
    assert [float(m.compute()) for m in metrics] == pytest.approx([1 / 3, 0.0, 1.0, 0.0])
    metrics[0].update(engine, engine, torch.tensor([[True, True]]))  # two more agreeing tokens
    assert float(metrics[0].compute()) == pytest.approx(1 / 9)


def test_empty_and_bad_inputs():
    assert float(RoutingDisagreement().compute()) == 0.0
    metric = RoutingDisagreement(layer=5)
    routing = torch.zeros(1, 2, 3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="layer=5"):
        metric.update(routing, routing, torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="trainer_routing must be"):
        RoutingDisagreement().update(routing, routing.float(), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="layer must be"):
        RoutingDisagreement(layer=-1)
