"""Gradient accumulation (``GRPOSettings.micro_batch_size``): micro-batches that each divide by the whole batch's
count (``loss.denominator``) give the whole batch's loss, gradient and logged stats."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.losses import GRPOLoss, TBPOLoss
from ais_lightning.modules.grpo import GRPOModule, GRPOSettings
from tests.modules.test_grpo_module import _fit, _module


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 5
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False  # ragged responses
    mask[4, 1:] = False
    old = -torch.rand(B, T, generator=g) - 0.1  # [B, T]
    rollout = old + 0.3 * torch.randn(B, T, generator=g)  # [B, T]
    logp = (old + 0.05 * torch.randn(B, T, generator=g)).requires_grad_()  # [B, T]
    adv = torch.randn(B, generator=g)  # [B]
    return logp, old, rollout, adv, mask


@pytest.mark.parametrize(
    "loss",
    [
        GRPOLoss(aggregation="token-mean"),
        GRPOLoss(aggregation="seq-mean-token-mean"),
        GRPOLoss(aggregation="seq-mean-token-sum-norm", max_response_length=5),
        TBPOLoss(band_low=0.8, band_high=1.25),
    ],
    ids=["token-mean", "seq-mean-token-mean", "dr-grpo", "tbpo"],
)
def test_micro_batches_add_up_to_the_batch(loss):
    logp, old, rollout, adv, mask = batch()
    whole = loss(logp, old, adv, mask, rollout_logprobs=rollout)
    (grad_whole,) = torch.autograd.grad(whole.loss, logp)
    den = loss.denominator(mask, old, rollout)
    parts = [slice(0, 2), slice(2, 5), slice(5, 6)]  # uneven micro-batches
    outs = [
        loss(logp[p], old[p], adv[p], mask[p], denominator=den, rollout_logprobs=rollout[p]) for p in parts
    ]
    total = sum(o.loss for o in outs)
    (grad_micro,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, whole.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_micro, grad_whole, rtol=1e-6, atol=1e-7)
    assert whole.shares and whole.shares <= whole.stats.keys()
    for key in whole.shares:  # the shares add up
        assert sum(o.stats[key] for o in outs) == pytest.approx(whole.stats[key], rel=1e-5, abs=1e-7)


def test_denominators_are_the_aggregations_counts():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])  # [3, 3]
    assert GRPOLoss(aggregation="token-mean").denominator(mask) == 3  # valid tokens
    assert GRPOLoss(aggregation="seq-mean-token-mean").denominator(mask) == 2  # sequences with a token
    assert GRPOLoss(aggregation="seq-mean-token-sum-norm", max_response_length=3).denominator(mask) == 3  # B
    old = torch.zeros(3, 3)
    rollout = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])  # row 2: m = e^1 > 1.25
    assert TBPOLoss(band_low=0.8, band_high=1.25).denominator(mask, old, rollout) == 1  # only row 0 kept
    with pytest.raises(ValueError, match="needs old_logprobs"):
        TBPOLoss().denominator(mask)


class RecordsGradients(GRPOModule):
    """Keeps the gradient the optimizer steps with (Adam's first step is scale-free: compare gradients)."""

    def on_before_optimizer_step(self, optimizer):
        self.grads = {
            n: p.grad.clone() for n, p in self.policy.model.named_parameters() if p.grad is not None
        }

    def update_policy(self, exp):
        self.update_stats = super().update_policy(exp)
        return self.update_stats


def test_a_micro_batched_step_makes_the_same_update():
    # 3 prompts x 4 = 12 rows; micro-batches of 5: 5 + 5 + 2 rows
    whole, micro = _module(cls=RecordsGradients), _module(cls=RecordsGradients, micro_batch_size=5)
    assert micro._micro_batching(12) and not whole._micro_batching(12)
    _fit(whole)
    _fit(micro)
    assert whole.grads and whole.grads.keys() == micro.grads.keys()
    assert any(bool(g.abs().max() > 0) for g in whole.grads.values())  # the batch carried a gradient
    for name, grad in whole.grads.items():
        torch.testing.assert_close(micro.grads[name], grad, rtol=1e-4, atol=1e-7)
    for key in ("loss/pg_loss", "loss/total", "loss/pg_clipfrac", "loss/ratio_mean", "train/grad_norm"):
        assert micro.update_stats[key] == pytest.approx(whole.update_stats[key], rel=1e-4, abs=1e-6)


def test_micro_batch_size_is_checked():
    with pytest.raises(ValueError, match="micro_batch_size"):
        GRPOSettings(micro_batch_size=0)
