"""The mismatch split into its precision and staleness parts, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning import ops
from ais_lightning.diagnostics import MismatchDiagnostics
from ais_lightning.staleness import MismatchSplit, split_log_ratio


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mu = -torch.rand(4, 6, generator=gen) * 3  # [B, T] log mu
    v = mu + 0.2 * torch.randn(4, 6, generator=gen)  # log pi_v: the precision moved it
    prox = v + 0.3 * torch.randn(4, 6, generator=gen)  # log pi_prox: the updates moved it on
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return prox, v, mu, mask


def test_the_parts_add_up_to_the_whole_and_k1_is_additive():
    prox, v, mu, mask = _batch()
    precision, staleness = split_log_ratio(prox, v, mu, mask)
    torch.testing.assert_close(precision + staleness, ops.log_ratio(prox, mu, mask), rtol=0, atol=1e-6)
    assert torch.equal(precision[1, 4:], torch.zeros(2)) and torch.equal(staleness[1, 4:], torch.zeros(2))
    split, whole = MismatchSplit(), MismatchDiagnostics()
    split.update(prox, v, mu, mask)
    whole.update(prox, mu, mask, entropy=torch.ones_like(mu))
    parts, total = split.compute(), whole.compute()
    k1 = parts["mismatch/precision/kl_k1"] + parts["mismatch/staleness/kl_k1"]
    torch.testing.assert_close(k1, total["mismatch/kl_k1"].to(k1.dtype), rtol=0, atol=1e-6)


def test_values_by_hand():
    prox = torch.log(torch.tensor([[0.5, 0.2]]))  # [B=1, T=2]
    v = torch.log(torch.tensor([[0.4, 0.2]]))
    mu = torch.log(torch.tensor([[0.2, 0.1]]))
    split = MismatchSplit(prefix="m/")
    split.update(prox, v, mu, torch.ones(1, 2, dtype=torch.bool))
    out = {k: float(x) for k, x in split.compute().items()}
    w_p, w_s = [2.0, 2.0], [1.25, 1.0]  # pi_v / mu, pi_prox / pi_v
    for part, w in (("precision", w_p), ("staleness", w_s)):
        assert out[f"m/{part}/kl_k1"] == pytest.approx(sum(-math.log(x) for x in w) / 2, abs=1e-6)
        assert out[f"m/{part}/kl_k3"] == pytest.approx(sum(x - 1 - math.log(x) for x in w) / 2, abs=1e-6)
        assert out[f"m/{part}/chi2_token"] == pytest.approx(sum(x * x for x in w) / 2 - 1, abs=1e-6)
        assert out[f"m/{part}/ess"] == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)), abs=1e-6)
    split.reset()
    assert float(split.compute()["m/staleness/kl_k3"]) == 0.0


def test_a_part_known_to_be_zero_is_zero():
    prox, v, mu, mask = _batch(1)
    fresh = MismatchSplit()  # generated with the current weights: pi_v = pi_prox
    fresh.update(prox, prox, mu, mask)
    out = fresh.compute()
    assert all(
        float(out[f"mismatch/staleness/{k}"]) == e for k, e in (("kl_k1", 0), ("kl_k3", 0), ("ess", 1))
    )
    assert float(out["mismatch/staleness/chi2_token"]) == 0.0
    exact = MismatchSplit()  # fp32 rollouts: mu = pi_v
    exact.update(prox, v, v, mask)
    out = exact.compute()
    assert float(out["mismatch/precision/kl_k3"]) == 0.0 and float(out["mismatch/staleness/kl_k3"]) > 0


def test_split_names_a_bad_tensor():
    prox, v, mu, mask = _batch()
    with pytest.raises(ValueError, match="version_logprobs"):
        split_log_ratio(prox, v[:, :3], mu, mask)
