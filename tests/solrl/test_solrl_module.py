"""SolRLModule with real Lightning Trainers on the tiny model: settings, one step per screening precision."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from ais_lightning.correctors import NoCorrection
from ais_lightning.losses import GRPOLoss
from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.modules.grpo import GRPOSettings
from ais_lightning.modules.solrl import SolRLModule, SolRLSettings
from ais_lightning.policy import Policy
from ais_lightning.rollout import RolloutEngine, TorchRolloutEngine
from ais_lightning.tasks.arithmetic import Arithmetic

PROMPTS = {"prompt": ["1+2=", "3+4=", "5+1="], "solution": ["3", "7", "6"], "answer": [3, 7, 6]}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


class MostlyOdd(Arithmetic):
    """A binary reward an untrained model already varies on: most characters have odd codes."""

    def reward(self, prompts, completions, **fields):
        return [float(sum(ord(c) % 2 for c in text) > len(text) / 2) for text in completions]


class Constant(Arithmetic):
    def reward(self, prompts, completions, **fields):
        return [0.5] * len(completions)


class NoNoiseEngine(RolloutEngine):
    """An engine whose generate() takes no uniforms table."""

    def __init__(self, model):
        self.engine = TorchRolloutEngine(model)

    def sync_weights(self, named):
        self.engine.sync_weights(named)

    def generate(self, prompts, sampling):
        return self.engine.generate(prompts, sampling)


def _module(precision="fp32", task=None, engine_factory=None, cls=SolRLModule, **settings) -> SolRLModule:
    defaults = dict(group_size=4, screen_group_size=8, max_new_tokens=6, lr=1e-3)
    return cls(
        policy=Policy(build_tiny_qwen3(seed=0), build_char_tokenizer()),
        task=task or MostlyOdd(digits=1),
        corrector=NoCorrection(),
        loss=GRPOLoss(),
        engine_factory=engine_factory or (lambda m: TorchRolloutEngine(m, precision=precision)),
        settings=SolRLSettings(**{**defaults, **settings}),
        eval_engine_factory=lambda m: TorchRolloutEngine(m, precision="fp32"),
    )


def _fit(module: SolRLModule, steps: int = 1) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = DataLoader([PROMPTS] * steps, batch_size=None, collate_fn=lambda b: b)
    trainer.fit(module, train_dataloaders=data)
    return trainer


def _weights(module):
    return {k: v.clone() for k, v in module.policy.model.state_dict().items()}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"screen_group_size": 4, "group_size": 8}, "screen_group_size"),
        ({"screen_group_size": 1, "group_size": 2}, "screen_group_size"),
        ({"selection": "best"}, "selection"),
        ({"train_prompts": -1}, "train_prompts"),
        ({"train_prompts": 17}, "train_prompts"),
        ({"mini_batches": 3, "group_size": 4, "prompts_per_step": 3}, "mini_batches"),
        ({"mini_batches": 8, "group_size": 4, "prompts_per_step": 4, "train_prompts": 3}, "mini_batches"),
        ({"informative_tol": -0.1}, "informative_tol"),
        ({"informative_tol": float("nan")}, "informative_tol"),
        ({"group_size": 1}, "group_size"),
    ],
)
def test_contradictory_settings_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SolRLSettings(**kwargs)


def test_default_settings_keep_the_papers_four_to_one_budget():
    s = SolRLSettings()
    assert s.screen_group_size == 4 * s.group_size
    assert isinstance(s, GRPOSettings) and SolRLSettings.module_class() is SolRLModule


def test_the_module_needs_a_trainer_precision_engine_and_solrl_settings():
    policy = Policy(build_tiny_qwen3(seed=0), build_char_tokenizer())
    args = dict(policy=policy, task=MostlyOdd(digits=1), corrector=NoCorrection(), loss=GRPOLoss())
    with pytest.raises(ValueError, match="eval_engine_factory"):
        SolRLModule(**args, engine_factory=TorchRolloutEngine, settings=SolRLSettings())
    with pytest.raises(ValueError, match="SolRLSettings"):
        SolRLModule(
            **args,
            engine_factory=TorchRolloutEngine,
            settings=GRPOSettings(),
            eval_engine_factory=TorchRolloutEngine,
        )


def test_equal_precision_screening_trains_on_exactly_the_screened_tokens():
    """fp32 screening and fp32 regeneration: every regenerated row is its cheap twin; the update is
    on-policy (mismatch ~ 0); the metrics and the history carry the screening figures."""
    module = _module("fp32")
    before = _weights(module)
    trainer = _fit(module)
    after = _weights(module)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert m["solrl/identical_frac"] == 1.0
    assert m["solrl/token_agreement"] == 1.0
    assert m["solrl/shared_token_frac"] == 1.0
    assert m["solrl/reward_agreement"] == 1.0
    assert m["mismatch/kl_k3"] < 1e-9
    assert m["solrl/informative_frac"] == 1.0, "the odd-character reward varies on every prompt"
    assert m["solrl/trained_prompts"] == 3
    # contrastive keep 4 of 8 with both rewards present among the screened: 2 right, 2 wrong per prompt
    assert m["reward/trained_mean"] == pytest.approx(0.5)
    assert m["solrl/regen_informative_frac"] == 1.0
    assert 0 < m["solrl/screen_time_frac"] < 1 and m["time/regen_s"] > 0 and m["time/screen_s"] > 0
    assert m["time/rollout_s"] == pytest.approx(m["time/screen_s"] + m["time/regen_s"])
    (entry,) = module.history
    assert entry["reward"] == pytest.approx(m["reward/mean"]), "the history's reward is the screened mean"
    assert entry["token_agreement"] == 1.0 and entry["informative_frac"] == 1.0


class Recording(SolRLModule):
    """SolRLModule recording the engines in place and the batch each half of its rollout step sees."""

    def generate_rollouts(self, prompts, *args, **kwargs):
        batch = super().generate_rollouts(prompts, *args, **kwargs)
        self.seen = [*getattr(self, "seen", []), ("generate", self.engine, batch.response_ids.shape[0])]
        return batch

    def build_experience(self, batch, prompts, fields, keep_graph=False):
        self.seen.append(("build", self.engine, batch.response_ids.shape[0]))
        return super().build_experience(batch, prompts, fields, keep_graph)


def test_screening_and_experience_are_two_calls_with_the_engine_in_place():
    """The cheap engine screens through ``generate_rollouts`` (K per prompt), the regenerated rows go to
    ``build_experience`` directly: the rollout engine is never swapped, and each history entry carries the
    screening figures (``HISTORY_STATS``)."""
    module = _module("fp32", cls=Recording)
    _fit(module)
    engine = module.engine
    assert module.seen == [("generate", engine, 3 * 8), ("build", engine, 3 * 4)]
    (entry,) = module.history
    assert set(SolRLModule.HISTORY_STATS) <= set(entry)
    assert entry["reward_trained"] == pytest.approx(0.5) and entry["identical_frac"] == 1.0


def test_fp4_screening_reports_its_agreement_and_still_trains_on_policy():
    module = _module("fp4", screen_group_size=16)
    m = {k: float(v) for k, v in _fit(module).callback_metrics.items()}
    assert 0.5 < m["solrl/token_agreement"] < 1.0
    assert m["solrl/identical_frac"] < 1.0
    assert m["solrl/shared_token_frac"] < 1.0
    assert m["mismatch/kl_k3"] < 1e-9, "regenerated rows carry the trainer precision's log-probs"


def test_no_informative_prompt_regenerates_one_and_changes_nothing():
    """All rewards equal: screening finds nothing; one prompt is regenerated, its advantages are 0, and
    the step leaves the weights as they were (a zero gradient, AdamW without weight decay)."""
    module = _module("int8", task=Constant(digits=1))
    before = _weights(module)
    m = {k: float(v) for k, v in _fit(module).callback_metrics.items()}
    assert m["solrl/informative_frac"] == 0.0 and m["solrl/trained_prompts"] == 1
    assert m["solrl/regen_informative_frac"] == 0.0
    assert m["reward/mean"] == 0.5
    assert module.bad_steps == 0, "a step without signal is not a bad step"
    assert all(torch.equal(before[k], v) for k, v in _weights(module).items())


def test_a_fixed_prompt_budget_trains_that_many_prompts():
    module = _module("int8", train_prompts=2, prompts_per_step=3)
    m = {k: float(v) for k, v in _fit(module).callback_metrics.items()}
    assert m["solrl/trained_prompts"] == 2


def test_an_engine_without_coupled_noise_is_refused_when_training_starts():
    module = _module(engine_factory=NoNoiseEngine)
    with pytest.raises(ValueError, match="uniforms"):
        _fit(module)


def test_two_steps_resync_the_regeneration_engine(monkeypatch):
    """After the first update the trainer-precision engine must regenerate with the new weights: on
    equal precision every regenerated row still equals its cheap twin at step 2, which it does not
    when the regeneration engine keeps the old weights."""
    module = _module("fp32", lr=1e-2)
    trainer = _fit(module, steps=2)
    assert trainer.global_step == 2
    assert float(trainer.callback_metrics["solrl/identical_frac"]) == 1.0
    assert float(trainer.callback_metrics["time/regen_sync_s"]) > 0

    stale = _module("fp32", lr=1e-2)
    monkeypatch.setattr(stale, "_sync_exact_engine", lambda: 0.0)
    assert float(_fit(stale, steps=2).callback_metrics["solrl/identical_frac"]) < 1.0
