"""Reuse: a stranger's own LightningModule uses ``AIS`` and ``MismatchDiagnostics`` and nothing else of ours.

A tiny linear categorical policy pi(token | context) is trained with an AIS-weighted policy-gradient
loss on synthetic rollouts whose log-probs come from a perturbed copy mu of the initial policy.
"""

from __future__ import annotations

import math
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ais_lightning.correctors import AIS
from ais_lightning.correctors.ais import MISSING_SPREAD
from ais_lightning.diagnostics import MismatchDiagnostics
from ais_lightning.ops import impurity_from_logprobs

NUM_CONTEXTS, VOCAB, LENGTH, ROWS = 4, 5, 6, 32


class TinyPolicyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.policy = nn.Linear(NUM_CONTEXTS, VOCAB)
        self.corrector = AIS(c=2.0)
        self.diagnostics = MismatchDiagnostics(prefix="mismatch/")

    def training_step(self, batch, batch_idx):
        contexts, tokens, rollout_logprobs, mask = batch
        logits = self.policy(nn.functional.one_hot(contexts, NUM_CONTEXTS).float())  # [B, T, V]
        log_pi = torch.log_softmax(logits, dim=-1)  # [B, T, V]
        logp = log_pi.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]
        train_logprobs = logp.detach()
        # the policy's spread 1 - sum_a pi(a)^2 per token, which AIS measures the mismatch against
        impurity = impurity_from_logprobs(log_pi.detach())  # [B, T]
        # reward: how often the policy emitted token 0; group-normalized advantage per sequence
        reward = ((tokens == 0) & mask).float().sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        advantages = (reward - reward.mean()) / (reward.std() + 1e-6)  # [B]
        out = self.corrector(train_logprobs, rollout_logprobs, mask, advantages=advantages, impurity=impurity)
        per_token = -out.weights * advantages[:, None] * logp  # [B, T]
        loss = per_token[out.mask].sum() / out.mask.sum().clamp(min=1)
        self.diagnostics(train_logprobs, rollout_logprobs, mask, advantages=advantages, impurity=impurity)
        self.log("ais/spread", out.stats["ais/spread"])
        self.log_dict(self.diagnostics)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def synthetic_rollouts(module: TinyPolicyModule) -> TensorDataset:
    """Tokens sampled from mu = the initial policy with perturbed logits; mu's log-probs recorded."""
    gen = torch.Generator().manual_seed(1)
    contexts = torch.randint(0, NUM_CONTEXTS, (ROWS, LENGTH), generator=gen)  # [N, T]
    with torch.no_grad():
        logits = module.policy(nn.functional.one_hot(contexts, NUM_CONTEXTS).float())  # [N, T, V]
        logits = logits + 0.8 * torch.randn(logits.shape, generator=gen)
        mu = torch.log_softmax(logits, dim=-1)
        tokens = torch.multinomial(mu.exp().reshape(-1, VOCAB), 1, generator=gen).reshape(ROWS, LENGTH)
        rollout_logprobs = mu.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [N, T]
    lengths = torch.randint(1, LENGTH + 1, (ROWS,), generator=gen)
    mask = torch.arange(LENGTH)[None, :] < lengths[:, None]  # [N, T]
    return TensorDataset(contexts, tokens, rollout_logprobs, mask)


def test_stranger_lightning_module_trains_with_ais_and_logs_diagnostics():
    module = TinyPolicyModule()
    loader = DataLoader(synthetic_rollouts(module), batch_size=8, shuffle=False)
    before = [p.detach().clone() for p in module.parameters()]
    trainer = L.Trainer(
        accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader)
    missing_spread = [w for w in caught if str(w.message) == MISSING_SPREAD]
    assert not missing_spread  # the spread reached AIS and the metric

    assert trainer.global_step == 5
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    metrics = trainer.callback_metrics
    names = [
        "kl_k1",
        "kl_k3",
        "chi2_token",
        "chi2_seq",
        "ess",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "ratio_frac_above",
        "ratio_frac_below",
        "ppl_ratio",
        "ais_lambda",
    ]
    for name in names:
        value = float(metrics[f"mismatch/{name}"])
        assert math.isfinite(value), name
    assert math.isfinite(float(metrics["train/loss"]))
    # mu really differs from pi: positive KL, ESS below 1, lambda a valid mixing coefficient
    assert float(metrics["mismatch/kl_k3"]) > 1e-3
    assert 0.0 < float(metrics["mismatch/ess"]) < 1.0
    assert 0.0 <= float(metrics["mismatch/ais_lambda"]) <= 1.0
    uniform_impurity = 1.0 - 1.0 / VOCAB  # the largest impurity; the fallback without one is G = 1
    assert 0.0 < float(metrics["ais/spread"]) < uniform_impurity + 1e-6
