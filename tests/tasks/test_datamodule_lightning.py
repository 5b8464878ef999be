"""The train loader's position survives a real Lightning checkpoint (fit_loop combined_loader state)."""

import lightning as L
import pytest
import torch

from ais_lightning.tasks import PromptDataModule, get_task


class Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[str]] = []
        self.val_batches = 0

    def training_step(self, batch, batch_idx):
        self.seen.append(list(batch["prompt"]))
        return (self.w - 1).pow(2).sum()

    def validation_step(self, batch, batch_idx):
        self.val_batches += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, train_size, max_steps, ckpt_path=None, callbacks=()):
    dm = PromptDataModule(
        get_task("arithmetic"), train_size=train_size, val_size=4, batch_size=2, seed=3, batches_per_epoch=4
    )
    model = Recorder()
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("train_size", [8, None])
def test_resume_from_checkpoint_continues_the_stream(tmp_path, train_size):
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1
    )
    full = fit(tmp_path, train_size, max_steps=7, callbacks=[ckpt])
    assert len(full.seen) == 7 and full.val_batches == 2  # 4 batches per epoch: epochs end at steps 4 and 7
    assert full.seen[0] != full.seen[4]
    for step in (2, 4):  # mid-epoch, and saved on the last batch of epoch 0
        resumed = fit(tmp_path, train_size, max_steps=7, ckpt_path=tmp_path / f"step={step}.ckpt")
        assert resumed.seen == full.seen[step:], f"resume from step {step}"
