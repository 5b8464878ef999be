"""``algorithm=solrl`` composes against its schema and fails clearly on contradictory options."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from ais_lightning.app.build import validate
from ais_lightning.app.config import CONFIG_DIR, register_configs
from ais_lightning.modules.solrl import SolRLSettings

register_configs()


def make(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=["output_dir=/tmp/ais-test-unused", *overrides])


def test_solrl_builds_its_settings_without_a_corrector():
    c = validate(make("algorithm=solrl"))
    assert isinstance(c.algorithm, SolRLSettings)
    assert type(c.corrector).__name__ == "NoCorrection"
    assert c.eval_engine is not None, "the trainer-precision copy regenerates"
    assert c.algorithm.module_class().__name__ == "SolRLModule"


def test_the_smoke_experiment_sets_the_screening_budget():
    cfg = make("experiment=solrl_smoke", "rollout=fp4")
    c = validate(cfg)
    assert (c.algorithm.prompts_per_step, c.algorithm.screen_group_size, c.algorithm.group_size) == (4, 8, 4)
    assert cfg.rollout.precision == "fp4"


def test_a_misspelled_screening_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="algorithm.screen_group_sise"):
        make("algorithm=solrl", "algorithm.screen_group_sise=8")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algorithm.screen_group_size=4"], "algorithm.screen_group_size"),
        (["algorithm.selection=best"], "algorithm.selection"),
        (["algorithm.train_prompts=99"], "algorithm.train_prompts"),
        (["trainer=fsdp2"], "algorithm.train_prompts"),
    ],
)
def test_contradictory_values_fail_validation_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        validate(make("algorithm=solrl", *overrides))


def test_an_engine_without_coupled_noise_or_trainer_copy_is_refused():
    """The rules ``validate`` asks the algorithm to check, on engines that lack what Sol-RL needs."""
    import functools
    import types

    from ais_lightning.app.trainer import TrainerSettings
    from ais_lightning.rollout import RolloutEngine, TorchRolloutEngine

    class NoNoise(RolloutEngine):
        def sync_weights(self, named_tensors):
            raise AssertionError("never built")

        def generate(self, prompts, sampling):
            raise AssertionError("never built")

    settings = SolRLSettings()
    parts = dict(
        engine=functools.partial(TorchRolloutEngine, precision="int8"),
        trainer=TrainerSettings(),
        workers=None,
    )
    settings.check_components(
        types.SimpleNamespace(**parts, eval_engine=functools.partial(TorchRolloutEngine))
    )
    with pytest.raises(ValueError, match="algorithm=solrl.*uniforms.*NoNoise"):
        settings.check_components(
            types.SimpleNamespace(**{**parts, "engine": functools.partial(NoNoise)}, eval_engine=None)
        )
    with pytest.raises(ValueError, match="trainer-precision copy"):
        settings.check_components(types.SimpleNamespace(**parts, eval_engine=None))
