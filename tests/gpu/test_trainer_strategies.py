"""The trainer's strategies, built on CPU: FSDP2 on GPUs (trainer=fsdp_gpu) and on CPU (trainer=fsdp2).

Lightning's ModelParallelStrategy with ``data_parallel_size="auto"`` takes the node count as the
data-parallel size (``strategies/model_parallel.py``, ``setup_environment``), which fails its own mesh
check (dp x tp == world size) on any node with two devices: ``ais-train trainer=fsdp2`` stopped with
"The sizes data_parallel_size=1 and tensor_parallel_size=1 multiplied should equal the world size (2)".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir

from ais_lightning.app.build import validate
from ais_lightning.app.config import CONFIG_DIR, register_configs
from ais_lightning.app.trainer import TrainerSettings
from tests.gpu.fake_cuda import fake_cuda

register_configs()


def _trainer(*overrides: str) -> TrainerSettings:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        # rollout=bf16: a GPU trainer refuses the default integer-GEMM int8 engine unless it is placed on the CPU
        cfg = compose("train", overrides=["output_dir=/tmp/unused", "rollout=bf16", *overrides])
    return validate(cfg).trainer


def test_fsdp2_on_cpu_puts_every_process_in_the_data_parallel_mesh():
    settings = _trainer("trainer=fsdp2")
    strategy = settings.strategy_object()
    trainer = L.Trainer(
        accelerator=settings.accelerator, devices=settings.devices, strategy=strategy, logger=False
    )
    assert type(trainer.strategy).__name__ == "ModelParallelStrategy"
    assert trainer.world_size == 2
    # the mesh check Lightning runs in setup_environment (fabric/strategies/model_parallel.py)
    assert strategy._data_parallel_size * strategy._tensor_parallel_size == trainer.world_size
    assert strategy.process_group_backend == "gloo"


@pytest.mark.parametrize(
    "devices, nodes, gpus, expected",
    [("auto", 1, 4, 4), (-1, 1, 2, 2), (2, 1, 8, 2), ([0, 3], 1, 8, 2), ("0,1,2", 1, 8, 3), (8, 2, 8, 16)],
)
def test_fsdp_gpu_is_fsdp2_over_nccl_on_every_gpu(monkeypatch, devices, nodes, gpus, expected):
    fake_cuda(monkeypatch, capability=(9, 0), count=gpus)
    settings = _trainer("trainer=fsdp_gpu")
    assert (settings.strategy, settings.accelerator) == ("fsdp2", "gpu")
    settings.devices, settings.num_nodes = devices, nodes
    strategy = settings.strategy_object()
    assert type(strategy).__name__ == "ModelParallelStrategy"
    assert strategy.process_group_backend == "nccl"
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (expected, 1)


def test_fsdp_gpu_rolls_out_on_the_gpu_by_default(monkeypatch):
    """``trainer=fsdp_gpu`` picks a GPU rollout itself (the torch engine in bf16 on each rank's GPU) instead of the
    default integer-GEMM int8 engine, which runs on the CPU only (refused beside a GPU trainer on a host with VNNI,
    emulated elsewhere); an explicit ``rollout=`` still wins."""
    fake_cuda(monkeypatch, capability=(9, 0), count=1)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["output_dir=/tmp/unused", "trainer=fsdp_gpu"])
        chosen = compose("train", overrides=["output_dir=/tmp/unused", "trainer=fsdp_gpu", "rollout=fp8"])
        cpu = compose("train", overrides=["output_dir=/tmp/unused"])
    components = validate(cfg)
    assert cfg.rollout.precision == "bf16" and components.engine.checked_arguments["device"] is None
    assert components.engine.checked_arguments["backend"] is None  # no integer GEMM: the model's (GPU) device
    assert chosen.rollout.precision == "fp8" and cpu.rollout.precision == "int8"


def test_fsdp_gpu_without_cuda_names_the_requirement(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="trainer.strategy=fsdp2.*needs CUDA GPUs.*trainer=fsdp2: gloo"):
        _trainer("trainer=fsdp_gpu").strategy_object()


@pytest.mark.slow
def test_ais_train_fsdp2_runs_validation_training_and_a_weight_sync_on_cpu(tmp_path):
    """The real entry point over 2 gloo processes: validation before training (engine built from the
    sharded policy's full state dict), one rollout step and its weight sync, the summary written."""
    exe = Path(sys.executable).with_name("ais-train")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            str(exe),
            "trainer=fsdp2",
            "trainer.max_steps=1",
            "trainer.enable_progress_bar=false",
            "warmstart=disabled",
            "logger=none",
            "algorithm.prompts_per_step=2",
            "algorithm.group_size=2",
            "algorithm.val_size=2",
            f"output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "summary.json").exists(), proc.stdout[-2000:]
