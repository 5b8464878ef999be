"""GRPOModule with real Lightning Trainers on the tiny model: one step trains, bad numbers never do."""

from __future__ import annotations

import dataclasses
import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from ais_lightning.correctors import AIS
from ais_lightning.losses import GRPOLoss
from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.modules.grpo import GRPOModule, GRPOSettings
from ais_lightning.policy import Policy
from ais_lightning.rollout import RolloutEngine, TorchRolloutEngine
from ais_lightning.tasks.arithmetic import Arithmetic


class OddCharacters(Arithmetic):
    """A reward an untrained model already varies on (so advantages are not all zero)."""

    def reward(self, prompts, completions, **fields):
        return [sum(ord(c) % 2 for c in text) / max(len(text), 1) for text in completions]


class NaNRollouts(RolloutEngine):
    """A real engine whose rollout log-probs come back NaN (a broken low-precision kernel)."""

    def __init__(self, model):
        self.engine = TorchRolloutEngine(model, precision="fp32")

    def sync_weights(self, named):
        self.engine.sync_weights(named)

    def generate(self, prompts, sampling):
        batch = self.engine.generate(prompts, sampling)
        return dataclasses.replace(
            batch, rollout_logprobs=torch.full_like(batch.rollout_logprobs, float("nan"))
        )


class NaNLoss(GRPOLoss):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        return dataclasses.replace(out, loss=out.loss * float("nan"))


def _module(
    engine_factory=None, loss=None, cls=GRPOModule, policy_cls=Policy, corrector=None, **settings
) -> GRPOModule:
    return cls(
        policy=policy_cls(build_tiny_qwen3(seed=0), build_char_tokenizer()),
        task=OddCharacters(digits=1),
        corrector=corrector or AIS(),
        loss=loss or GRPOLoss(),
        engine_factory=engine_factory or (lambda m: TorchRolloutEngine(m, precision="fp32")),
        settings=GRPOSettings(group_size=4, max_new_tokens=4, lr=1e-3, **settings),
    )


def _fit(module: GRPOModule) -> L.Trainer:
    batch = {"prompt": ["1+2=", "3+4=", "5+1="], "solution": ["3", "7", "6"], "answer": [3, 7, 6]}
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=DataLoader([batch], batch_size=None, collate_fn=lambda b: b))
    return trainer


def _weights(module: GRPOModule) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.policy.model.state_dict().items()}


def test_one_step_updates_the_policy_and_syncs_the_engine():
    module = _module()
    before = _weights(module)
    trainer = _fit(module)
    after = _weights(module)
    assert trainer.global_step == 1
    assert any(not torch.equal(before[k], after[k]) for k in before)
    metrics = trainer.callback_metrics
    for key in (
        "reward/mean",
        "mismatch/kl_k3",
        "ais/lambda",
        "loss/pg_loss",
        "train/entropy",
        "errors/repeat_frac",
    ):
        assert torch.isfinite(metrics[key]), key
    assert metrics["mismatch/kl_k3"] < 1e-9, "fp32 engine and fp32 trainer agree"
    assert len(module.history) == 1
    # The engine now generates with the updated weights: its log-probs equal the policy's.
    engine_state = dict(module.engine.model.state_dict())
    for name, value in module.policy.model.state_dict().items():
        if name in engine_state and engine_state[name].shape == value.shape:
            torch.testing.assert_close(engine_state[name], value)


class TwoCalls(GRPOModule):
    """GRPOModule recording the two halves of its rollout step."""

    def on_train_start(self):
        super().on_train_start()
        rollouts = self.source.rollouts

        def recorded(step, request, version):
            self.generated = rollouts(step, request, version)
            self.steps_seen = [*getattr(self, "steps_seen", []), ("generate", len(request.prompt_ids), step)]
            return self.generated

        self.source.rollouts = recorded

    def build_experience(self, batch, prompts, fields, keep_graph=False, versions=None, dropped=0):
        same = torch.equal(batch.response_ids, self.generated.batch.response_ids)
        self.steps_seen.append(("build", same, versions))
        return super().build_experience(batch, prompts, fields, keep_graph, versions, dropped)


def test_a_rollout_step_is_generation_then_experience_building():
    """``collect_experience`` = the rollout source's batch (the in-process engine at the current weights,
    ``group_size`` rows per prompt, stamped with the current version) then ``build_experience`` on that very batch;
    the stats time the generation."""
    module = _module(cls=TwoCalls)
    trainer = _fit(module)
    assert type(module.source).__name__ == "InlineSource"
    assert module.steps_seen[0] == ("generate", 3, 0)
    (_, same, versions) = module.steps_seen[1]
    assert same and versions.tolist() == [0] * 3 * module.settings.group_size
    assert module.generated.batch.response_ids.shape[0] == 3 * module.settings.group_size
    assert trainer.callback_metrics["time/rollout_s"] > 0
    assert trainer.callback_metrics["throughput/rollout_tokens_per_s"] > 0


def test_logged_lambda_diagnostic_is_the_lambda_ais_uses():
    """mismatch/ais_lambda sees the corrector's advantages and entropy, so on the same batch it
    equals the AIS corrector's own lambda (no EMA); without the entropy it would assume H = 1."""
    module = _module(engine_factory=lambda m: TorchRolloutEngine(m, precision="fp4"))
    metrics = _fit(module).callback_metrics
    assert metrics["ais/lambda"] > 0, "fp4 rollouts of the tiny model mismatch the fp32 trainer"
    torch.testing.assert_close(metrics["mismatch/ais_lambda"], metrics["ais/lambda"], rtol=1e-5, atol=1e-7)


class SkewedRollouts(NaNRollouts):
    """A real engine whose log mu is lowered by log 3 on every other response position: ratios ~3 there, between the
    clip bounds 2 and 4 (a broken kernel that under-weights half the tokens)."""

    def generate(self, prompts, sampling):
        batch = self.engine.generate(prompts, sampling)
        odd = torch.arange(batch.rollout_logprobs.shape[1]) % 2 == 1  # [T]
        skewed = torch.where(
            odd & batch.response_mask, batch.rollout_logprobs - math.log(3.0), batch.rollout_logprobs
        )
        return dataclasses.replace(batch, rollout_logprobs=skewed)


@pytest.mark.parametrize("c", [2.0, 4.0])
def test_the_mismatch_diagnostics_use_the_correctors_clip_bound(c):
    """corrector.c = 4: mismatch/ais_lambda is the corrector's lambda at C = 4 (not a second lambda at C = 2), and
    the ratio fractions count the ratios beyond 4 (none of the ~3s) and below 1/4."""
    module = _module(engine_factory=SkewedRollouts, corrector=AIS(c=c))
    assert module.mismatch["ratio_frac_above"].c == c and module.mismatch["ratio_frac_below"].c_low == 1 / c
    metrics = _fit(module).callback_metrics
    assert (metrics["mismatch/ratio_frac_above"] > 0.2) == (c == 2.0)  # the ~3s are above 2, not above 4
    torch.testing.assert_close(metrics["mismatch/ais_lambda"], metrics["ais/lambda"], rtol=1e-5, atol=1e-7)


class RecordingAIS(AIS):
    """AIS that keeps what the module hands its statistics (the spread's inputs)."""

    def statistics(self, delta, mask, base, advantages, entropy, impurity=None):
        self.seen = (mask.clone(), entropy.clone(), impurity.clone())
        return super().statistics(delta, mask, base, advantages, entropy, impurity)


def test_ais_measures_its_spread_with_the_trainers_impurity():
    """The module passes the trainer's collision impurity (not only the entropy): ais/spread is its mean
    over valid tokens, below the entropy bound 1 - exp(-H) token by token."""
    module = _module(engine_factory=lambda m: TorchRolloutEngine(m, precision="fp4"))
    module.corrector = RecordingAIS()
    metrics = _fit(module).callback_metrics
    mask, entropy, impurity = module.corrector.seen
    assert bool(mask.any())
    assert torch.all(impurity[mask] > 0) and torch.all(impurity[mask] < -torch.expm1(-entropy[mask]))
    want = impurity[mask].double().mean()
    torch.testing.assert_close(metrics["ais/spread"].double(), want, rtol=1e-6, atol=0)


def test_nonfinite_rollout_logprobs_skip_the_update_but_count_as_a_step():
    """No weight changes, yet the step counts toward max_steps (an empty optimizer step): a run of bad
    steps still ends instead of looping forever."""
    module = _module(engine_factory=NaNRollouts)
    before = _weights(module)
    trainer = _fit(module)
    assert trainer.global_step == 1
    assert all(torch.equal(before[k], v) for k, v in _weights(module).items())
    assert trainer.callback_metrics["train/nonfinite_logprobs"] == 1.0
    assert trainer.callback_metrics["train/skipped_updates"] == 1.0
    assert module.history == []
    assert module.bad_steps == 1


def test_nonfinite_loss_skips_the_optimizer_step():
    module = _module(loss=NaNLoss())
    before = _weights(module)
    trainer = _fit(module)
    assert trainer.global_step == 1
    assert all(torch.equal(before[k], v) for k, v in _weights(module).items())
    assert trainer.callback_metrics["train/skipped_updates"] == 1.0


def test_consecutive_bad_steps_abort_the_run_naming_the_cause():
    module = _module(engine_factory=NaNRollouts, max_bad_steps=1)
    with pytest.raises(RuntimeError, match="non-finite log-probs.*max_bad_steps"):
        _fit(module)


class CountingPolicy(Policy):
    """A Policy that counts its log-prob passes."""

    calls = 0

    def batch_logprobs(self, *args, **kwargs):
        self.calls += 1
        return super().batch_logprobs(*args, **kwargs)


class FreshLossForward(GRPOModule):
    """GRPOModule whose loss always runs its own forward (pi_old's forward without autograd)."""

    def collect_experience(self, prompts, fields, keep_graph=False):
        self.kept = keep_graph
        return super().collect_experience(prompts, fields, keep_graph=False)


def _counted(cls=GRPOModule, **settings) -> GRPOModule:
    fp4 = lambda m: TorchRolloutEngine(m, precision="fp4")  # noqa: E731
    return _module(engine_factory=fp4, cls=cls, policy_cls=CountingPolicy, **settings)


def test_one_optimizer_step_per_batch_reuses_pi_olds_forward_for_the_loss_bit_for_bit():
    """At ppo_epochs * mini_batches == 1 the loss takes pi_old's forward (kept with its graph): one policy
    pass per step instead of two, and the same weights after the step, bit for bit, as with a fresh one."""
    fused, fresh = _counted(), _counted(FreshLossForward)
    before = _weights(fused)
    _fit(fused), _fit(fresh)
    assert fresh.kept, "training_step asks for the graph at one optimizer step per batch"
    assert (fused.policy.calls, fresh.policy.calls) == (1, 2)
    a, b = _weights(fused), _weights(fresh)
    assert any(not torch.equal(a[k], before[k]) for k in a), "the step moved the weights"
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("schedule", [{"ppo_epochs": 2}, {"mini_batches": 2}])
def test_several_optimizer_steps_per_batch_run_the_loss_forward_each_time(schedule):
    """pi_old is fixed while the weights move: each optimizer step needs its own forward."""
    module = _counted(FreshLossForward, **schedule)
    _fit(module)
    assert not module.kept
    assert module.policy.calls == 1 + 2
