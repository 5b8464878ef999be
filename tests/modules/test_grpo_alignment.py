"""GRPOModule's mismatch options: dropping mismatched responses before the advantages, the fp32 alignment gate.

The engines are the fp32 torch engine (log mu = log pi_old to rounding) with chosen rows' rollout log-probs
shifted by a constant c on their valid tokens, so every such token has |log pi_old - log mu| = |c| and the
response's mean exp|delta| is exactly e^|c|.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ais_lightning.correctors import NoCorrection
from ais_lightning.losses import GRPOLoss, group_advantages
from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.modules.grpo import GRPOModule, GRPOSettings
from ais_lightning.policy import Policy
from ais_lightning.rollout import RolloutEngine, TorchRolloutEngine
from tests.modules.test_grpo_module import OddCharacters, _fit

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Shifted(RolloutEngine):
    """The fp32 torch engine with the rollout log-probs of ``rows`` (None: all) shifted by ``shift``."""

    def __init__(self, model, shift: float, rows: list[int] | None = None):
        self.engine = TorchRolloutEngine(model, precision="fp32")
        self.shift, self.rows = shift, rows

    def sync_weights(self, named):
        self.engine.sync_weights(named)

    def generate(self, prompts, sampling):
        batch = self.engine.generate(prompts, sampling)
        lp = batch.rollout_logprobs.clone()  # [B, T]
        rows = torch.zeros(lp.shape[0], dtype=torch.bool)
        rows[self.rows if self.rows is not None else slice(None)] = True
        hit = batch.response_mask & rows.unsqueeze(-1)  # [B, T]
        return dataclasses.replace(batch, rollout_logprobs=torch.where(hit, lp + self.shift, lp))


class Recording(GRPOModule):
    """Keeps the experience the update trains on."""

    def update_policy(self, exp):
        self.exp = exp
        return super().update_policy(exp)


def fp32(model):
    return TorchRolloutEngine(model, precision="fp32")


def _module(engine_factory=fp32, eval_engine_factory=None, **settings) -> Recording:
    return Recording(
        policy=Policy(build_tiny_qwen3(seed=0), build_char_tokenizer()),
        task=OddCharacters(digits=1),
        corrector=NoCorrection(),
        loss=GRPOLoss(),
        engine_factory=engine_factory,
        eval_engine_factory=eval_engine_factory,
        settings=GRPOSettings(group_size=4, max_new_tokens=4, lr=1e-3, **settings),
    )


def test_a_mismatched_response_is_dropped_before_the_advantages():
    """Row 0 shifted by 1: its mean exp|delta| is e = 2.718 > 1.5, every other row's is 1 (fp32): row 0 leaves the
    loss and its group's baseline; the metrics still see it (seq_mult_prob_error_max = e)."""
    shifted = lambda m: Shifted(m, shift=-1.0, rows=[0])  # noqa: E731
    module = _module(engine_factory=shifted, seq_logprob_error_threshold=1.5)
    metrics = _fit(module).callback_metrics
    exp = module.exp
    assert float(metrics["train/dropped_by_logprob_error"]) == 1.0
    assert not bool(exp.loss_mask[0].any())
    assert torch.equal(exp.loss_mask[1:], exp.rollout.response_mask[1:])
    assert float(exp.advantages[0]) == 0.0
    # group 0 is rows 0-3: the kept rows 1-3 get the advantages of a group of their own
    torch.testing.assert_close(exp.advantages[1:4], group_advantages(exp.rewards[1:4], 3))
    torch.testing.assert_close(exp.advantages[4:], group_advantages(exp.rewards[4:], 4))
    assert float(metrics["mismatch/seq_mult_prob_error_max"]) == pytest.approx(math.e, rel=1e-5)


def test_the_drop_is_off_by_default():
    shifted = lambda m: Shifted(m, shift=-1.0, rows=[0])  # noqa: E731
    module = _module(engine_factory=shifted)
    metrics = _fit(module).callback_metrics
    assert "train/dropped_by_logprob_error" not in metrics
    assert bool(module.exp.loss_mask[0].any())
    torch.testing.assert_close(module.exp.advantages, group_advantages(module.exp.rewards, 4))


def test_the_fp32_gate_passes_an_aligned_engine_and_logs_its_value():
    module = _module(eval_engine_factory=lambda m: fp32(m), max_fp32_mult_prob_error=1.05)
    trainer = _fit(module)
    assert trainer.global_step == 1
    assert module.eval_engine is not module.engine  # the separate trainer-precision engine was measured
    assert float(trainer.callback_metrics["alignment/fp32_token_mult_prob_error"]) == pytest.approx(
        1.0, abs=1e-5
    )


def test_the_fp32_gate_stops_a_misaligned_run_naming_the_setting_and_the_value():
    """Every token of the fp32 engine shifted by 0.1: token_mult_prob_error = e^0.1 = 1.105171 > 1.05."""
    module = _module(eval_engine_factory=lambda m: Shifted(m, shift=0.1), max_fp32_mult_prob_error=1.05)
    before = {k: v.clone() for k, v in module.policy.model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"1\.1051\d* > algorithm\.max_fp32_mult_prob_error=1\.05"):
        _fit(module)
    assert all(torch.equal(before[k], v) for k, v in module.policy.model.state_dict().items())  # no update


def test_the_fp32_gate_needs_the_trainer_precision_engine():
    module = _module(max_fp32_mult_prob_error=1.05)
    with pytest.raises(
        ValueError, match="algorithm.max_fp32_mult_prob_error=1.05 needs the trainer-precision"
    ):
        _fit(module)


@pytest.mark.parametrize("name", ["seq_logprob_error_threshold", "max_fp32_mult_prob_error"])
@pytest.mark.parametrize("bad", [0.5, math.inf, math.nan, True])
def test_bad_thresholds_name_themselves(name, bad):
    with pytest.raises(ValueError, match=name):
        GRPOSettings(**{name: bad})
