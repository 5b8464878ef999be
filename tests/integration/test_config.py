"""Every config option composes against its schema, validates, and builds its cheap components."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import ais_lightning
from ais_lightning.build import build_corrector, build_loss, build_task
from ais_lightning.config import register_configs, validate

CONF = Path(ais_lightning.__file__).parent / "conf"
register_configs()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def make(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=["output_dir=/tmp/ais-test-unused", *overrides])


def test_configs_ship_inside_the_package():
    assert (CONF / "train.yaml").exists()
    assert {
        "policy",
        "rollout",
        "corrector",
        "task",
        "algorithm",
        "trainer",
        "logger",
        "experiment",
        "sweep",
    } <= {p.name for p in CONF.iterdir() if p.is_dir()}


@pytest.mark.parametrize("name", options("corrector"))
def test_every_corrector_option_builds(name):
    cfg = make(f"corrector={name}")
    validate(cfg)
    corrector = build_corrector(cfg.corrector)
    loss = build_loss(cfg.algorithm, max_response_length=8, corrector=cfg.corrector)
    expected = {"none": "NoCorrection", "tis": "TIS", "mis": "MIS", "ais": "AIS", "qarl": "NoCorrection"}
    assert type(corrector).__name__ == expected[cfg.corrector.name]
    assert type(loss).__name__ == ("TBPOLoss" if name == "qarl" else "GRPOLoss")


@pytest.mark.parametrize("name", [n for n in options("task") if n != "gsm8k"])
def test_every_task_option_builds(name):
    cfg = make(f"task={name}")
    validate(cfg)
    task = build_task(cfg.task)
    assert task.sample(__import__("random").Random(0)).prompt


@pytest.mark.parametrize(
    "group", ["rollout", "algorithm", "trainer", "logger", "warmstart", "policy", "experiment"]
)
def test_every_option_of_the_remaining_groups_composes(group):
    for name in options(group):
        cfg = make(f"{group}={name}")
        if group == "policy" and name == "local":
            with pytest.raises(ValueError, match="policy.path"):
                validate(make("policy=local", "policy.path=null"))
            continue
        validate(cfg)
        build_loss(cfg.algorithm, max_response_length=cfg.algorithm.max_new_tokens)


def test_typo_in_a_key_fails_at_composition_naming_it():
    with pytest.raises(ConfigCompositionException, match="corrector.c_hihg"):
        make("corrector.c_hihg=3")


def test_wrong_type_fails_at_composition_naming_the_key():
    with pytest.raises(ConfigCompositionException, match="algorithm.group_size"):
        make("algorithm.group_size=abc")


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.precision=fp16", "rollout.precision"),
        ("corrector.name=foo", "corrector.name"),
        ("algorithm.aggregation=mean", "algorithm.aggregation"),
        ("algorithm.mini_batches=3", "algorithm.mini_batches"),
        ("algorithm.temperature=0", "algorithm.temperature"),
        ("algorithm.top_p=0.9", "top_p"),
        ("algorithm.mode=bypass", "algorithm.mode=bypass"),
        ("trainer.max_steps=0", "trainer.max_steps"),
    ],
)
def test_contradictory_values_fail_validation_naming_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(make(override))


def test_qarl_sets_the_aligned_forward_and_needs_a_quantized_rollout():
    cfg = make("corrector=qarl", "rollout=fp8")
    assert cfg.policy.aligned_quantization == "rollout"
    validate(cfg)
    with pytest.raises(ValueError, match="aligned_quantization=rollout"):
        validate(make("corrector=qarl", "rollout=fp32"))


def test_bypass_mode_with_no_corrector_is_valid():
    validate(make("algorithm.mode=bypass", "corrector=none"))


def test_sweep_preset_lists_the_four_correctors():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["output_dir=/x", "sweep=correctors"], return_hydra_config=True)
    assert cfg.hydra.sweeper.params.corrector == "none,tis,mis,ais"


def test_console_script_finds_the_packaged_configs():
    """``ais-train`` (the console script) composes from the configs inside the installed package."""
    import shutil
    import subprocess
    import sys

    script = Path(sys.executable).with_name("ais-train")
    exe = str(script) if script.exists() else shutil.which("ais-train")
    assert exe, "ais-train is not installed"
    proc = subprocess.run(
        [exe, "--cfg", "job", "corrector=tis_geo"], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr
    assert "level: geometric" in proc.stdout
    help_text = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=300, cwd="/").stdout
    assert help_text.startswith("ais-train: GRPO on low-precision rollouts")
    corrector_line = next(line for line in help_text.splitlines() if line.startswith("corrector:"))
    assert set(options("corrector")) <= {o.strip() for o in corrector_line.split(":")[1].split(",")}


def test_fsdp_gpu_strategy_fails_clearly_without_cuda():
    import torch

    from ais_lightning.train import _strategy

    cfg = make("trainer=fsdp_gpu")
    validate(cfg)
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the strategy builds (covered by the GPU test)")
    with pytest.raises(ValueError, match="trainer.strategy=fsdp"):
        _strategy(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_fsdp_gpu_strategy_builds_on_cuda():
    from lightning.pytorch.strategies import FSDPStrategy

    from ais_lightning.train import _strategy

    assert isinstance(_strategy(make("trainer=fsdp_gpu")), FSDPStrategy)
