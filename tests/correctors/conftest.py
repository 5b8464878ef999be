"""Shared builders for the corrector tests."""

from __future__ import annotations

import pytest
import torch


def logprobs_for_ratios(ratios, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_logprobs, rollout_logprobs, mask) whose token ratios pi/mu are ``ratios``."""
    r = torch.tensor(ratios, dtype=torch.float64)
    rollout = torch.full_like(r, -2.0)  # log mu, exactly representable
    train = rollout + torch.log(r)  # log pi
    return train.float(), rollout.float(), torch.tensor(mask, dtype=torch.bool)


# The worked example of test_tis_mis.py: 3 responses, the last token of response 1 is padding
# (its ratio 0.01 must never matter, not even for the veto).
RATIOS = [[3.0, 0.25, 1.5], [0.8, 1.25, 0.01], [0.1, 0.2, 0.4]]
MASK = [[True, True, True], [True, True, False], [True, True, True]]
# Per-response products: 3 * 0.25 * 1.5 = 1.125, 0.8 * 1.25 = 1.0, 0.1 * 0.2 * 0.4 = 0.008.
# Geometric means: 1.125 ** (1/3) = 1.0400419, 1.0 ** (1/2) = 1.0, 0.008 ** (1/3) = 0.2.


def random_inputs(seed: int, batch: int, length: int, scale: float, p_valid: float = 0.7):
    """Random log-probs with log-ratios of size ~``scale`` and a random (possibly empty) mask."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(batch, length, generator=g) * 5.0 - 0.01  # log mu < 0
    train = rollout + torch.randn(batch, length, generator=g) * scale
    mask = torch.rand(batch, length, generator=g) < p_valid
    advantages = torch.randn(batch, generator=g)
    entropy = torch.rand(batch, length, generator=g) * 3.0
    return train, rollout, mask, advantages, entropy


@pytest.fixture(scope="session")
def make_logprobs():
    """The ``logprobs_for_ratios`` builder (test modules cannot import conftest under importlib mode)."""
    return logprobs_for_ratios


@pytest.fixture(scope="session")
def example():
    """The worked example: (train_logprobs, rollout_logprobs, mask) for ``RATIOS`` / ``MASK``."""
    return logprobs_for_ratios(RATIOS, MASK)


@pytest.fixture(scope="session")
def make_random_inputs():
    """The ``random_inputs`` builder, for hypothesis tests (session scope: no per-example reset)."""
    return random_inputs
