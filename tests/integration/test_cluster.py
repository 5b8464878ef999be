"""Cluster scale through existing engines: a SLURM (submitit) launcher option for sweeps and multi-node FSDP2
through Lightning. Nothing here needs a cluster: the configs are composed and the Lightning wiring is checked
under the environment SLURM gives a task."""

from __future__ import annotations

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from ais_lightning.app.build import validate
from ais_lightning.app.config import CONFIG_DIR, register_configs
from tests.integration.helpers import RENDEZVOUS_VARIABLES

register_configs()
pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

# a GPU trainer with a GPU rollout (the default rollout=int8 is a CPU kernel: refused beside a GPU trainer)
MULTI_NODE = [
    "trainer=fsdp2",
    "trainer.accelerator=gpu",
    "trainer.devices=8",
    "trainer.num_nodes=2",
    "rollout=bf16",
]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=["output_dir=/tmp/unused", *overrides], return_hydra_config=True)


def test_slurm_launcher_option_gives_each_sweep_point_nodes_times_devices_tasks():
    cfg = _compose("hydra/launcher=slurm", "hydra.launcher.partition=gpu", *MULTI_NODE)
    HydraConfig.instance().set_config(cfg)  # resolves ${trainer.*} in the launcher node
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)
    assert launcher.partition == "gpu"
    settings = validate(cfg).trainer
    assert settings.world_size == 16


def test_multi_node_fsdp2_takes_its_ranks_from_slurm(monkeypatch):
    """A task of a 2-node x 2-device SLURM job: Lightning's SLURMEnvironment gives it its global rank."""
    env = {
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NAME": "ais-train",
        "SLURM_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # Lightning's SLURMEnvironment writes MASTER_ADDR (and others) into os.environ itself: registering them
    # with monkeypatch makes the teardown remove them, so later tests' processes do not rendezvous at node1.
    for key in RENDEZVOUS_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    # The strategy also sets the process-wide rank_zero_only.rank to this task's rank (3): restored after the
    # test, else every later logger in this process acts as a non-zero rank (a DummyExperiment).
    from lightning_utilities.core.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))
    s = validate(_compose("trainer=fsdp2", "trainer.devices=2", "trainer.num_nodes=2")).trainer
    trainer = L.Trainer(
        accelerator=s.accelerator,
        devices=s.devices,
        num_nodes=s.num_nodes,
        strategy=s.strategy_object(),
        logger=False,
    )
    assert type(trainer.strategy).__name__ == "ModelParallelStrategy"
    assert type(trainer.strategy.cluster_environment).__name__ == "SLURMEnvironment"
    assert (trainer.world_size, trainer.global_rank, trainer.node_rank, trainer.local_rank) == (4, 3, 1, 1)
    assert trainer.strategy.cluster_environment.main_address == "node1"
