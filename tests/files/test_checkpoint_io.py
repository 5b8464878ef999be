"""VerifiedCheckpointIO with a real Lightning Trainer: sidecars on save, refusal of corrupt checkpoints."""

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ais_lightning.files import CorruptFileError, VerifiedCheckpointIO, hash_path, sha256_file


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)), batch_size=2
    )


def trainer(tmp_path: Path, max_steps: int, **io_kwargs) -> L.Trainer:
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=1, save_last=True)
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        plugins=[VerifiedCheckpointIO(**io_kwargs)],
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fit_three_steps(tmp_path: Path) -> Path:
    L.seed_everything(0, verbose=False)
    trainer(tmp_path, 3).fit(Tiny(), loader())
    return tmp_path / "ckpt" / "last.ckpt"


def test_sidecars_written_and_removed_with_checkpoints(tmp_path):
    last = fit_three_steps(tmp_path)
    files = sorted(p.name for p in last.parent.iterdir())
    checkpoints = [f for f in files if f.endswith(".ckpt")]
    # save_top_k=1 removed the older step checkpoints, and their sidecars with them
    assert len(checkpoints) == 2 and sorted(f + ".sha256" for f in checkpoints) == [
        f for f in files if f.endswith(".sha256")
    ]
    for name in checkpoints:
        path = last.parent / name
        assert hash_path(path).read_text().split()[0] == sha256_file(path)


def test_resume_from_intact_checkpoint(tmp_path):
    last = fit_three_steps(tmp_path)
    t = trainer(tmp_path / "resume", 4)
    t.fit(Tiny(), loader(), ckpt_path=str(last))
    assert t.global_step == 4


def test_flipped_byte_refused_naming_the_path(tmp_path):
    last = fit_three_steps(tmp_path)
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0x10
    last.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match") as info:
        trainer(tmp_path / "resume", 4).fit(Tiny(), loader(), ckpt_path=str(last))
    assert str(last) in str(info.value) and isinstance(info.value, CorruptFileError)


def test_missing_sidecar_refused_unless_allowed(tmp_path):
    last = fit_three_steps(tmp_path)
    hash_path(last).unlink()
    with pytest.raises(ValueError, match=r"no hash file last\.ckpt\.sha256.*sha256sum last\.ckpt") as info:
        trainer(tmp_path / "resume", 4).fit(Tiny(), loader(), ckpt_path=str(last))
    assert str(last) in str(info.value)
    t = trainer(tmp_path / "resume2", 4, allow_missing_hash=True)
    t.fit(Tiny(), loader(), ckpt_path=str(last))
    assert t.global_step == 4


def test_symlinked_checkpoint_is_verified_through_its_target(tmp_path):
    last = fit_three_steps(tmp_path)
    link = tmp_path / "link.ckpt"
    link.symlink_to(last)
    io = VerifiedCheckpointIO()
    assert io.load_checkpoint(link)["global_step"] == 3
    data = bytearray(last.read_bytes())
    data[-10] ^= 0x01
    last.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="link.ckpt"):
        io.load_checkpoint(link)


def test_remote_paths_rejected():
    with pytest.raises(ValueError, match="local paths"):
        VerifiedCheckpointIO().load_checkpoint("s3://bucket/x.ckpt")
