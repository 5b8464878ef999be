"""GRPO with a float16 policy and fp16 rollouts on the tiny model: it trains, skips overflows, resumes exactly."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

from ais_lightning.correctors import NoCorrection
from ais_lightning.losses import GRPOLoss
from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.modules.grpo import GRPOModule, GRPOSettings
from ais_lightning.modules.mixed_precision import DynamicLossScale, MasterWeightOptimizer
from ais_lightning.policy import Policy
from ais_lightning.rollout import TorchRolloutEngine
from tests.modules.test_grpo_module import OddCharacters

BATCH = {"prompt": ["1+2=", "3+4=", "5+1="], "solution": ["3", "7", "6"], "answer": [3, 7, 6]}


class HugeLossScale(GRPOModule):
    """A loss scale of 2^40: every scaled fp16 gradient overflows."""

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        opt.loss_scale = DynamicLossScale(init_scale=2.0**40)
        return opt


def _module(cls=GRPOModule) -> GRPOModule:
    return cls(
        policy=Policy(build_tiny_qwen3(seed=0).half(), build_char_tokenizer()),
        task=OddCharacters(digits=1),
        corrector=NoCorrection(),
        loss=GRPOLoss(),
        engine_factory=lambda m: TorchRolloutEngine(m, precision="fp16"),
        settings=GRPOSettings(group_size=4, max_new_tokens=4, lr=1e-3, prompts_per_step=3, mini_batches=2),
    )


def _trainer(epochs: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )


def _loader() -> DataLoader:
    return DataLoader([BATCH], batch_size=None, collate_fn=lambda b: b)


def _master(module: GRPOModule) -> MasterWeightOptimizer:
    opt = module.optimizers().optimizer
    assert isinstance(opt, MasterWeightOptimizer)
    return opt


def test_an_fp16_step_trains_on_fp32_masters_and_syncs_the_fp16_engine():
    module = _module()
    before = {k: v.clone() for k, v in module.policy.model.state_dict().items()}
    trainer = _trainer(1)
    trainer.fit(module, train_dataloaders=_loader())
    assert trainer.global_step == 2
    metrics = trainer.callback_metrics
    assert metrics["train/skipped_updates"] == 0
    assert metrics["train/loss_scale"] == 2.0**16  # no overflow: GradScaler's initial scale
    assert torch.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0
    # Trainer and engine compute the same fp16 model (the lean forward vs Hugging Face's: rounding only).
    assert 0 <= metrics["mismatch/kl_k3"] < 1e-5
    after = module.policy.model.state_dict()
    assert all(v.dtype == torch.float16 for v in after.values() if v.is_floating_point())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    opt = _master(module)
    for p, m in zip(module.policy.parameters(), opt.masters()):
        assert m.dtype == torch.float32 and torch.equal(p.detach(), m.detach().half())
    engine = dict(module.engine.model.state_dict())
    for name, value in after.items():
        if name in engine and engine[name].shape == value.shape:
            assert torch.equal(engine[name], value), name


def test_overflowing_gradients_skip_the_step_and_back_off_the_scale():
    module = _module(HugeLossScale)
    before = {k: v.clone() for k, v in module.policy.model.state_dict().items()}
    trainer = _trainer(1)
    trainer.fit(module, train_dataloaders=_loader())
    assert trainer.global_step == 2, "skipped steps still count"
    assert trainer.callback_metrics["train/skipped_updates"] == 2
    assert _master(module).loss_scale.scale == 2.0**40 * 0.5**2
    after = module.policy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert module.bad_steps == 1


def test_the_checkpoint_holds_masters_and_loss_scale_and_resumes_exactly(tmp_path):
    straight = _module()
    _trainer(2).fit(straight, train_dataloaders=_loader())

    first = _module()
    trainer = _trainer(1)
    trainer.fit(first, train_dataloaders=_loader())
    path = tmp_path / "step.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["optimizer_states"][0]
    assert set(state) == {"inner", "masters", "loss_scale"}
    assert all(m.dtype == torch.float32 for m in state["masters"])
    assert state["loss_scale"]["scale"] == 2.0**16 and state["loss_scale"]["growth_tracker"] == 2

    resumed = _module()
    _trainer(2).fit(resumed, train_dataloaders=_loader(), ckpt_path=path)
    for a, b in zip(straight.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(_master(straight).masters(), _master(resumed).masters()):
        assert torch.equal(a, b)
    assert _master(straight).loss_scale.state_dict() == _master(resumed).loss_scale.state_dict()


def test_the_sft_warm_start_trains_a_float16_policy_outside_and_under_a_trainer():
    from ais_lightning.modules.sft import SFTModule

    tok = build_char_tokenizer()
    batch = {"prompt": ["1+2=", "3+4="], "solution": ["3", "7"]}
    module = SFTModule(Policy(build_tiny_qwen3(seed=0).half(), tok), tok, lr=3e-3, warmup_steps=0)
    opt = module.build_optimizer()
    assert isinstance(opt, MasterWeightOptimizer)
    losses = [module.train_step(opt, batch, lr=3e-3) for _ in range(5)]
    assert losses[-1] < losses[0]
    for p, m in zip(module.policy.parameters(), opt.masters()):
        assert p.dtype == torch.float16 and torch.equal(p.detach(), m.detach().half())

    under = SFTModule(Policy(build_tiny_qwen3(seed=0).half(), tok), tok, lr=3e-3, warmup_steps=0)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(under, train_dataloaders=DataLoader([batch] * 3, batch_size=None, collate_fn=lambda b: b))
    trained = under.optimizers().optimizer
    # GradScaler's first scale, 2^16, overflows the first SFT step's gradients once (skipped, halved), then fits
    assert opt.loss_scale.state_dict()["scale"] == 2.0**15 and opt.loss_scale.growth_tracker == 4
    assert isinstance(trained, MasterWeightOptimizer)
    assert trained.loss_scale.scale == 2.0**15 and trained.loss_scale.growth_tracker == 2
    for p, m in zip(under.policy.parameters(), trained.masters()):
        assert torch.equal(p.detach(), m.detach().half())
