"""AIS v1 (``AISv1``) on hand-computed examples: lambda, each component, switches, clamps, EMA, state_dict.

Example A: one response, ratios w = [1, 4], C = 2, no entropy, no advantages.
    w_C = [1, 2], N = 2
    R = (1 + 2)^2 / (2 * (1 + 4)) = 9 / 10 = 0.9
    D = mean(w - 1 - ln w) = (0 + (4 - 1 - ln 4)) / 2 = (3 - 1.3862944) / 2 = 0.8068528
    s = 1 - exp(-D / (1 * (1 + 1e-6))) = 1 - exp(-0.8068520) = 0.5537393   (H = 1 when not given)
    V = E[w_C^2] = (1 + 4) / 2 = 2.5, v = min(1, 1 / 2.5) = 0.4
    lambda = s R v = 0.5537393 * 0.9 * 0.4 = 0.1993462
    weights = (1 - lambda) + lambda w_C = [1, 1 + lambda] = [1, 1.1993462]
"""

from __future__ import annotations

import math

import pytest
import torch

from ais_lightning.correctors import AISv1
from ais_lightning.correctors.ais_v1 import ais_v1_coefficient, ais_v1_params, ais_v1_sufficient_statistics
from ais_lightning.ops import log_ratio

R_A = 0.9
D_A = (3.0 - math.log(4.0)) / 2.0
S_A = 1.0 - math.exp(-D_A / (1.0 + 1e-6))
V_A = 0.4
LAMBDA_A = S_A * R_A * V_A


@pytest.fixture
def example_a(make_logprobs):
    return make_logprobs([[1.0, 4.0]], [[True, True]])


def test_hand_values_of_the_numbers_above():
    # Guard against a typo in the constants themselves.
    assert D_A == pytest.approx(0.8068528, abs=1e-7)
    assert S_A == pytest.approx(0.5537393, abs=1e-6)
    assert LAMBDA_A == pytest.approx(0.1993462, abs=1e-6)


def test_lambda_and_components_on_example_a(example_a):
    out = AISv1(c=2.0)(*example_a)
    assert out.stats["ais/reliability"] == pytest.approx(R_A, abs=1e-6)
    assert out.stats["ais/kl_k3"] == pytest.approx(D_A, abs=1e-6)
    assert out.stats["ais/entropy"] == pytest.approx(1.0)
    assert out.stats["ais/severity"] == pytest.approx(S_A, abs=1e-6)
    assert out.stats["ais/variance_factor"] == pytest.approx(V_A, abs=1e-6)
    assert out.stats["ais/lambda_raw"] == pytest.approx(LAMBDA_A, abs=1e-6)
    assert out.stats["ais/lambda"] == pytest.approx(LAMBDA_A, abs=1e-6)
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1.0 + LAMBDA_A]]), atol=1e-6, rtol=0)
    assert out.mask.all()
    # w = 4 > C and lambda > 0: 1 of 2 tokens clipped; weight mean (1 + 1 + lambda) / 2.
    assert out.stats["corrector/clipped_frac"] == pytest.approx(0.5)
    assert out.stats["corrector/weight_mean"] == pytest.approx(1.0 + LAMBDA_A / 2, abs=1e-6)


def test_entropy_and_token_advantages(example_a):
    # H = 0.5: s = 1 - exp(-D / 0.500001) = 1 - exp(-1.6137024) = 0.8008520.
    # A = [1, -3]: V = mean((w_C A)^2) / mean(A^2) = ((1)^2 + (2 * -3)^2) / 2 / ((1 + 9) / 2) = 18.5 / 5 = 3.7.
    train, rollout, mask = example_a
    entropy = torch.tensor([[0.5, 0.5]])
    advantages = torch.tensor([[1.0, -3.0]])
    out = AISv1()(train, rollout, mask, advantages=advantages, entropy=entropy)
    s = 1.0 - math.exp(-D_A / (0.5 + 1e-6))
    assert s == pytest.approx(0.8008520, abs=1e-6)
    assert out.stats["ais/entropy"] == pytest.approx(0.5)
    assert out.stats["ais/severity"] == pytest.approx(s, abs=1e-6)
    assert out.stats["ais/variance_factor"] == pytest.approx(1 / 3.7, abs=1e-6)
    assert out.stats["ais/lambda"] == pytest.approx(s * 0.9 / 3.7, abs=1e-6)


def test_sequence_advantages_broadcast_to_tokens(make_logprobs):
    # Response 0: w = [1, 4] (w_C = [1, 2]), A = 1; response 1: w = [1, 1], A = 3.
    # V = (1 + 4 + 9 + 9) / (1 + 1 + 9 + 9) = 23 / 20 = 1.15, v = 1 / 1.15.
    train, rollout, mask = make_logprobs([[1.0, 4.0], [1.0, 1.0]], [[True, True], [True, True]])
    per_seq = AISv1()(train, rollout, mask, advantages=torch.tensor([1.0, 3.0]))
    per_token = AISv1()(train, rollout, mask, advantages=torch.tensor([[1.0, 1.0], [3.0, 3.0]]))
    assert per_seq.stats["ais/variance_factor"] == pytest.approx(1 / 1.15, abs=1e-6)
    assert per_seq.stats == per_token.stats


def test_zero_advantages_fall_back_to_second_moment(example_a):
    # All advantages 0 (GRPO group with equal rewards): V = E[w_C^2] = 2.5 as without advantages.
    out = AISv1()(*example_a, advantages=torch.zeros(1))
    assert out.stats["ais/variance_factor"] == pytest.approx(V_A, abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"use_severity": False}, R_A * V_A),
        ({"use_reliability": False}, S_A * V_A),
        ({"use_variance": False}, S_A * R_A),
        ({"use_severity": False, "use_reliability": False, "use_variance": False}, 1.0),
        ({"alpha": 2.0, "beta": 0.5}, S_A * R_A**2 * V_A**0.5),
        ({"kappa": 2.0}, (1.0 - math.exp(-D_A / (2.0 * (1.0 + 1e-6)))) * R_A * V_A),
    ],
)
def test_switches_and_exponents(example_a, kwargs, expected):
    out = AISv1(**kwargs)(*example_a)
    assert out.stats["ais/lambda"] == pytest.approx(expected, abs=1e-6)
    # The components are reported as measured even when switched off.
    assert out.stats["ais/reliability"] == pytest.approx(R_A, abs=1e-6)


def test_lambda_clamps(example_a):
    out = AISv1(lambda_max=0.1)(*example_a)
    assert out.stats["ais/lambda"] == pytest.approx(0.1)
    assert out.stats["ais/lambda_raw"] == pytest.approx(LAMBDA_A, abs=1e-6)
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1.1]]))
    assert AISv1(lambda_min=0.5)(*example_a).stats["ais/lambda"] == pytest.approx(0.5)


def test_fixed_lambda(example_a):
    out = AISv1(fixed_lambda=0.25)(*example_a)
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 0.75 + 0.25 * 2.0]]))
    assert out.stats["ais/lambda"] == 0.25
    assert out.stats["ais/lambda_raw"] == pytest.approx(LAMBDA_A, abs=1e-6)


def test_ema_across_two_calls_and_state_dict_round_trip(example_a, make_logprobs):
    on_policy = make_logprobs([[1.0, 1.0]], [[True, True]])  # lambda_raw = 0 (s = 0)
    ais = AISv1(ema_decay=0.5)
    first = ais(*example_a)
    assert first.stats["ais/lambda"] == pytest.approx(LAMBDA_A, abs=1e-6)  # first step uses raw
    state = {k: v.clone() for k, v in ais.state_dict().items()}  # a checkpoint is a copy
    assert set(state) == {"ema_lambda", "ema_steps"}
    second = ais(*on_policy)
    # lambda_2 = 0.5 * lambda_1 + 0.5 * 0
    assert second.stats["ais/lambda_raw"] == 0.0
    assert second.stats["ais/lambda"] == pytest.approx(0.5 * LAMBDA_A, abs=1e-6)

    restored = AISv1(ema_decay=0.5)
    restored.load_state_dict(state)
    assert restored(*on_policy).stats["ais/lambda"] == pytest.approx(0.5 * LAMBDA_A, abs=1e-6)
    # Without the state the same call starts a fresh EMA.
    assert AISv1(ema_decay=0.5)(*on_policy).stats["ais/lambda"] == 0.0


def test_ema_does_not_advance_in_eval_mode(example_a, make_logprobs):
    on_policy = make_logprobs([[1.0, 1.0]], [[True, True]])
    ais = AISv1(ema_decay=0.5)
    ais(*example_a)
    ais.eval()
    assert ais(*on_policy).stats["ais/lambda"] == pytest.approx(0.5 * LAMBDA_A, abs=1e-6)
    assert ais(*on_policy).stats["ais/lambda"] == pytest.approx(0.5 * LAMBDA_A, abs=1e-6)
    assert int(ais.ema_steps) == 1


def test_sufficient_statistics_are_additive(make_random_inputs):
    train, rollout, mask, adv, ent = make_random_inputs(0, 6, 5, 0.5)
    delta = log_ratio(train, rollout, mask)
    whole = ais_v1_sufficient_statistics(delta, mask, 2.0, advantages=adv, entropy=ent)
    parts = sum(
        ais_v1_sufficient_statistics(
            delta[i : i + 2], mask[i : i + 2], 2.0, advantages=adv[i : i + 2], entropy=ent[i : i + 2]
        )
        for i in (0, 2, 4)
    )
    torch.testing.assert_close(parts, whole)
    # Independent check of the first entries: N, sum w_C, sum w_C^2.
    w_c = delta.double().exp().clamp(max=2.0)[mask]
    torch.testing.assert_close(
        whole[:3],
        torch.stack([torch.tensor(float(mask.sum()), dtype=torch.float64), w_c.sum(), (w_c**2).sum()]),
    )


def test_k3_is_accurate_for_tiny_mismatch():
    # delta = 1e-4 on every token: k3 = e^d - 1 - d = d^2/2 + d^3/6 = 5.0001667e-9 per token.
    delta = torch.full((2, 3), 1e-4, dtype=torch.float64).float()
    mask = torch.ones(2, 3, dtype=torch.bool)
    d = float(delta[0, 0])  # the float32 value actually used
    expected = d * d / 2 + d**3 / 6
    coef = ais_v1_coefficient(ais_v1_sufficient_statistics(delta, mask, 2.0), ais_v1_params())
    assert float(coef["kl_k3"]) == pytest.approx(expected, rel=1e-6)


def test_repr_mentions_options():
    assert "ema_decay=0.9" in repr(AISv1(ema_decay=0.9))
