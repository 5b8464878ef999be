"""Bad values fail at validation, before the warm start, with the key named (issue cases 1 and 5)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from ais_lightning.app.build import validate
from ais_lightning.app.config import CONFIG_DIR, register_configs
from ais_lightning.rollout.base import SamplingConfig

register_configs()


def make(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=["output_dir=/tmp/ais-test-unused", *overrides])


@pytest.mark.parametrize(
    "override, key",
    [
        ("algorithm.temperature=nan", "algorithm.temperature"),  # case 1: ran forever before
        ("algorithm.temperature=inf", "algorithm.temperature"),
        ("algorithm.group_size=1", "algorithm.group_size"),  # zero advantages, zero gradient
        ("algorithm.top_p=1.5", "algorithm.top_p"),
        ("algorithm.weight_decay=-1", "algorithm.weight_decay"),
        ("algorithm.lr=nan", "algorithm.lr"),
        ("algorithm.max_bad_steps=0", "algorithm.max_bad_steps"),
        ("trainer.checkpoint_every_n_steps=-1", "trainer.checkpoint_every_n_steps"),
        ("trainer.keep_checkpoints=-1", "trainer.keep_checkpoints"),
        ("trainer.keep_checkpoints=2", "trainer.keep_checkpoints"),  # without checkpoint_every_n_steps
        ("trainer.num_threads=0", "trainer.num_threads"),
        ("trainer.num_nodes=0", "trainer.num_nodes"),
        ("trainer.strategy=ddp_spawn", "trainer.strategy"),
        ("logger.name=wandb", "logger.name"),
        ("policy.dtype=float64", "policy.dtype"),
    ],
)
def test_bad_values_fail_validation_naming_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(make(override))


def test_sampling_config_rejects_a_nan_temperature():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=float("nan"))


def test_an_int8_cpu_engine_beside_a_gpu_trainer_is_refused_unless_placed_on_the_cpu(int8_isa):
    # the default rollout=int8 runs on an integer GEMM (CPU only): torch._int_mm with AVX512-VNNI, fbgemm's without
    backend = {"vnni": "int8", "avx2": "fbgemm"}[int8_isa]
    with pytest.raises(ValueError, match=rf"rollout\.backend={backend} .*rollout\.device=cpu"):
        validate(make("trainer.accelerator=gpu"))
    validate(make("trainer.accelerator=gpu", "rollout.device=cpu"))
