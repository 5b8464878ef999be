"""Progressive precision in GRPO training (issue #18): the aligned forward and the rollout engine move through
the stages together, the stage is logged, and a resumed run lands in the stage of its step."""

from __future__ import annotations

import csv
import functools
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from ais_lightning.correctors import NoCorrection
from ais_lightning.losses import TBPOLoss
from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
from ais_lightning.modules.grpo import GRPOModule, GRPOSettings
from ais_lightning.policy import Policy
from ais_lightning.quant import QuantLinear
from ais_lightning.rollout import TorchRolloutEngine
from ais_lightning.tasks.arithmetic import Arithmetic
from tests.integration.helpers import run_train

SCHEDULE = [[0, "int8_nested"], [1, "int4"], [3, "int2"]]
EXPECTED = {0: "int8_nested", 1: "int4", 2: "int4", 3: "int2"}  # recipe of each rollout step
BATCH = {"prompt": ["1+2=", "3+4=", "5+1="], "solution": ["3", "7", "6"], "answer": [3, 7, 6]}


class OddCharacters(Arithmetic):
    """A reward an untrained model already varies on (so advantages are not all zero)."""

    def reward(self, prompts, completions, **fields):
        return [sum(ord(c) % 2 for c in text) / max(len(text), 1) for text in completions]


class Record(Callback):
    """Per rollout step: the engine's precision, the trainer's recipes and the logged stage metrics."""

    def __init__(self):
        self.rows: dict[int, dict] = {}
        self.engine_before: dict[int, str] = {}  # the engine's precision before the step's own switch
        self.validated: dict[int, str] = {}  # steps done -> the engine's precision in that validation

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.engine_before[module.rollout_step] = module.engine.precision

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self.validated[module.rollout_step] = module.engine.precision

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = module.rollout_step - 1  # the step just trained
        metrics = trainer.callback_metrics
        self.rows[step] = {
            "engine": module.engine.precision,
            "trainer": {m.recipe.name for m in module.policy.model.modules() if isinstance(m, QuantLinear)},
            "stage": float(metrics["quant/stage"]),
            "bits": float(metrics["quant/bits"]),
            "kl": float(metrics["mismatch/kl_k3"]),
        }


def _module() -> GRPOModule:
    return GRPOModule(
        policy=Policy(build_tiny_qwen3(seed=0), build_char_tokenizer(), aligned_schedule=SCHEDULE),
        task=OddCharacters(digits=1),
        corrector=NoCorrection(),
        loss=TBPOLoss(),
        engine_factory=functools.partial(TorchRolloutEngine, precision="int8_nested"),
        settings=GRPOSettings(group_size=4, max_new_tokens=4, lr=1e-3),
        seed=0,
    )


def _loader(n: int) -> DataLoader:
    return DataLoader([BATCH] * n, batch_size=None, collate_fn=lambda b: b)


def _fit(
    module: GRPOModule, max_steps: int, root: Path, ckpt_path: str | None = None, validate: bool = False
) -> Record:
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        callbacks=[record, ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1 if validate else 0,
        val_check_interval=1,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(module, train_dataloaders=_loader(8), val_dataloaders=_loader(1), ckpt_path=ckpt_path)
    return record


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def test_stages_switch_trainer_and_engine_together_and_a_resume_lands_in_its_stage(tmp_path):
    full = _fit(_module(), 4, tmp_path / "full")
    bits = {"int8_nested": 8.0, "int4": 4.0, "int2": 2.0}
    stages = {"int8_nested": 0.0, "int4": 1.0, "int2": 2.0}
    for step, recipe in EXPECTED.items():
        row = full.rows[step]
        assert row["engine"] == recipe and row["trainer"] == {recipe}, (step, row)
        assert row["stage"] == stages[recipe] and row["bits"] == bits[recipe], (step, row)

    # Resume from the checkpoint written after step 2 (global step 2): the fresh policy starts at stage 0,
    # the restored step puts trainer and engine in stage 1 before anything is generated.
    ckpt = next((tmp_path / "full").glob("*step=2.ckpt"))
    resumed = _fit(_module(), 4, tmp_path / "resumed", ckpt_path=str(ckpt))
    assert sorted(resumed.rows) == [2, 3]
    assert resumed.engine_before[2] == "int4"  # on_train_start already moved the rebuilt engine to stage 1
    for step in (2, 3):
        ours, theirs = resumed.rows[step], full.rows[step]
        assert {k: ours[k] for k in ("engine", "trainer", "stage", "bits")} == {
            k: theirs[k] for k in ("engine", "trainer", "stage", "bits")
        }
        # same weights, same stage, same per-step seed: the same rollouts, hence the same mismatch
        assert ours["kl"] == pytest.approx(theirs["kl"], rel=1e-6, abs=1e-12), step


def test_the_stage_before_the_first_step_is_stage_zero(tmp_path):
    """Validation before training (trainer.validate, as ais-train runs it) builds the engine at stage 0."""
    module = _module()
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.validate(module, dataloaders=_loader(1), verbose=False)
    assert module.engine.precision == "int8_nested"
    assert {m.recipe.name for m in module.policy.model.modules() if isinstance(m, QuantLinear)} == {
        "int8_nested"
    }


def test_a_validation_measures_the_stage_of_the_last_step_trained(tmp_path):
    """Validation after step s (s steps done) runs the engine in the stage of step s - 1, the one just trained;
    the next training step switches on to its own stage."""
    record = _fit(_module(), 4, tmp_path, validate=True)
    assert record.validated == {steps: EXPECTED[steps - 1] for steps in (1, 2, 3, 4)}
    assert {step: row["engine"] for step, row in record.rows.items()} == EXPECTED


@pytest.mark.slow
def test_ais_train_logs_the_stage_of_every_step(tmp_path):
    out = tmp_path / "run"
    run_train(
        [
            "experiment=bitbybit_progressive",  # the preset, shrunk to seconds
            "warmstart=disabled",
            "logger=csv",
            "trainer.num_threads=1",
            "trainer.max_steps=3",
            "algorithm.prompts_per_step=4",
            "algorithm.group_size=4",
            "algorithm.max_new_tokens=4",
            "algorithm.val_every_n_steps=3",
            "algorithm.val_size=8",
            "policy.aligned_schedule=[[0,int8_nested],[1,int4],[2,int2]]",
            f"hydra.run.dir={out}",
        ],
        tmp_path,
    )
    (metrics,) = out.glob("csv/**/metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("quant/stage")]
    assert [(float(r["quant/stage"]), float(r["quant/bits"])) for r in rows] == [(0, 8), (1, 4), (2, 2)]
