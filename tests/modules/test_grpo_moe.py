"""GRPO on the tiny Qwen3-MoE with int8 rollouts: routing disagreement logged beside the mismatch KL, replay on/off."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from ais_lightning.correctors import TIS
from ais_lightning.losses import GRPOLoss
from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3_moe
from ais_lightning.modules.grpo import GRPOModule, GRPOSettings
from ais_lightning.policy import Policy
from ais_lightning.rollout import TorchRolloutEngine
from tests.modules.test_grpo_module import OddCharacters, _fit

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _fit_moe(router_replay: bool, precision: str = "fp4") -> tuple[GRPOModule, L.Trainer]:
    module = GRPOModule(
        policy=Policy(build_tiny_qwen3_moe(seed=0), build_char_tokenizer(), router_replay=router_replay),
        task=OddCharacters(digits=1),
        corrector=TIS(),
        loss=GRPOLoss(),
        engine_factory=lambda m: TorchRolloutEngine(m, precision=precision),
        settings=GRPOSettings(group_size=4, max_new_tokens=6, lr=1e-3),
    )
    return module, _fit(module)


@pytest.mark.parametrize("router_replay", [False, True])
def test_routing_disagreement_is_logged_beside_the_mismatch_kl(router_replay):
    module, trainer = _fit_moe(router_replay)
    metrics = trainer.callback_metrics
    assert trainer.global_step == 1
    assert torch.isfinite(metrics["mismatch/kl_k3"])
    overall = float(metrics["routing/disagreement"])
    layers = [float(metrics[f"routing/disagreement_layer{i}"]) for i in range(4)]
    assert 0 < overall < 1  # fp4 rollouts: the trainer's own routers pick other experts on some tokens
    assert overall == pytest.approx(sum(layers) / 4)  # the same tokens in every layer
    assert module.engine.model.model.layers[0].mlp.experts.recipe.name == "nvfp4"
