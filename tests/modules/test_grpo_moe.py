"""GRPO on the tiny Qwen3-MoE with int8 rollouts: routing disagreement logged beside the mismatch KL, replay on/off."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from ais_lightning.correctors import TIS
from ais_lightning.losses import GRPOLoss
from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3_moe
from ais_lightning.modules.grpo import GRPOModule, GRPOSettings
from ais_lightning.policy import Policy
from ais_lightning.rollout import TorchRolloutEngine
from ais_lightning.tasks.arithmetic import Arithmetic

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class OddCharacters(Arithmetic):
    def reward(self, prompts, completions, **fields):
        return [sum(ord(c) % 2 for c in text) / max(len(text), 1) for text in completions]


def _fit(router_replay: bool, precision: str = "fp4") -> tuple[GRPOModule, L.Trainer]:
    module = GRPOModule(
        policy=Policy(build_tiny_qwen3_moe(seed=0), build_char_tokenizer(), router_replay=router_replay),
        task=OddCharacters(digits=1),
        corrector=TIS(),
        loss=GRPOLoss(),
        engine_factory=lambda m: TorchRolloutEngine(m, precision=precision),
        settings=GRPOSettings(group_size=4, max_new_tokens=6, lr=1e-3),
    )
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
    return module, trainer


@pytest.mark.parametrize("router_replay", [False, True])
def test_routing_disagreement_is_logged_beside_the_mismatch_kl(router_replay):
    module, trainer = _fit(router_replay)
    metrics = trainer.callback_metrics
    assert trainer.global_step == 1
    assert torch.isfinite(metrics["mismatch/kl_k3"])
    overall = float(metrics["routing/disagreement"])
    layers = [float(metrics[f"routing/disagreement_layer{i}"]) for i in range(4)]
    assert 0 < overall < 1  # fp4 rollouts: the trainer's own routers pick other experts on some tokens
    assert overall == pytest.approx(sum(layers) / 4)  # the same tokens in every layer
    assert module.engine.model.model.layers[0].mlp.experts.recipe.name == "nvfp4"
