"""M2PO's adaptive second-moment mask (AReaL) by hand and against a direct transcription of AReaL's rule.

Worked example of conftest.py; m2 = (ln w)^2 of the 8 valid tokens, sorted descending:
    w:   0.1       0.2       0.25      3.0       0.4       1.5       0.8       1.25
    m2:  5.301898  2.590290  1.921812  1.206949  0.839589  0.164402  0.049793  0.049793
suffix means mean(m2[i:]), i = 0..7:
         1.515566  0.974661  0.705390  0.462105  0.275894  0.087996  0.049793  0.049793
"""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.correctors import M2PO, m2po_cut

T, F = True, False
SUFFIX = [1.515566, 0.974661, 0.705390, 0.462105, 0.275894, 0.087996, 0.049793, 0.049793]


def areal_rule(m2: list[float], tau: float) -> set[int]:
    """Indices AReaL masks: sort descending, k = first i with mean(sorted[i:]) < tau (else n - 1)."""
    order = sorted(range(len(m2)), key=lambda i: -m2[i])
    k = len(m2) - 1
    for i in range(len(m2)):
        rest = [m2[j] for j in order[i:]]
        if sum(rest) / len(rest) < tau:
            k = i
            break
    return set(order[:k])


@pytest.mark.parametrize(
    ("tau", "keep"),
    [
        # tau = 0.1: first suffix mean below is i = 5 (0.087996): mask 0.1, 0.2, 0.25, 3.0, 0.4.
        (0.1, [[F, F, T], [T, T, F], [F, F, F]]),
        # tau = 0.5: i = 3 (0.462105): mask 0.1, 0.2, 0.25.
        (0.5, [[T, F, T], [T, T, F], [F, F, T]]),
        # tau = 2: the batch mean 1.515566 is already below: nothing masked.
        (2.0, [[T, T, T], [T, T, F], [T, T, T]]),
    ],
)
def test_mask_by_hand(example, tau, keep):
    out = M2PO(tau=tau)(*example)
    assert torch.equal(out.mask, torch.tensor(keep))
    train, rollout, _ = example
    w = torch.exp(train - rollout)
    torch.testing.assert_close(out.weights, torch.where(torch.tensor(keep), w, torch.zeros_like(w)))
    n_masked = 8 - sum(map(sum, keep))
    assert out.stats["m2po/masked_frac"] == pytest.approx(n_masked / 8)
    assert out.stats["m2po/m2_mean"] == pytest.approx(SUFFIX[0], rel=1e-5)
    assert out.stats["m2po/m2_mean_kept"] == pytest.approx(SUFFIX[n_masked], rel=1e-5)
    assert out.stats["m2po/m2_mean_kept"] < tau


def test_ratio_rejection_on_top(example):
    # tau = 0.5 keeps 3.0, 1.5, 0.8, 1.25, 0.4; c_high = 2 also rejects the 3.0.
    out = M2PO(tau=0.5, c_high=2.0)(*example)
    assert torch.equal(out.mask, torch.tensor([[F, F, T], [T, T, F], [F, F, T]]))
    assert out.stats["m2po/masked_frac"] == pytest.approx(3 / 8)  # the M2PO rule alone
    assert out.stats["corrector/masked_frac"] == pytest.approx(4 / 8)


def test_nothing_below_tau_keeps_only_the_smallest(make_logprobs):
    # m2 = ln^2 3 = 1.207 and ln^2 0.1 = 5.302; tau = 0.01: no suffix mean below, mask all but one.
    out = M2PO(tau=0.01)(*make_logprobs([[3.0, 0.1]], [[T, T]]))
    assert torch.equal(out.mask, torch.tensor([[T, F]]))


def test_padding_is_ignored(make_logprobs):
    # The padded 1e-4 (m2 = 84.8) would dominate the mean if it counted.
    out = M2PO(tau=0.1)(*make_logprobs([[1.2, 1.1, 1e-4]], [[T, T, F]]))
    assert torch.equal(out.mask, torch.tensor([[T, T, F]]))
    assert out.stats["m2po/m2_mean"] == pytest.approx((math.log(1.2) ** 2 + math.log(1.1) ** 2) / 2, rel=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_matches_areals_rule_on_random_batches(seed, make_random_inputs):
    train, rollout, mask, _, _ = make_random_inputs(seed, 6, 9, 0.4)
    delta = (train - rollout).double()
    m2 = [float(x) for x in delta[mask].square()]
    for tau in (0.01, 0.04, 0.1, 0.3):
        masked = areal_rule(m2, tau)
        got = M2PO(tau=tau)(train, rollout, mask).mask[mask].tolist()
        assert {i for i, kept in enumerate(got) if not kept} == masked, tau


def test_cut_of_a_tied_group_masks_the_whole_group():
    # m2 = 4, 1, 1, 1, 0: suffix means 1.4, 0.75, 0.667, 0.5, 0.
    values = torch.tensor([4.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    # tau = 0.8: k = 1, v = 4: only the 4.
    assert float(m2po_cut(values, 0.8)) == 4.0
    # tau = 0.7: k = 2, v = s[1] = 1: AReaL masks the 4 and one of the tied 1s (whichever its sort
    # puts first); here all m2 >= 1 go, the rest's mean (0) is still below tau.
    assert float(m2po_cut(values, 0.7)) == 1.0
    assert math.isinf(float(m2po_cut(values, 2.0)))  # the mean 1.4 is below: nothing
    assert math.isinf(float(m2po_cut(values[:0], 0.1)))


@pytest.mark.parametrize(
    ("kwargs", "name"), [(dict(tau=0.0), "tau"), (dict(tau=-1), "tau"), (dict(c_high=0.5), "c_high")]
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        M2PO(**kwargs)
