"""A user's own corrector joins ``ais-train`` with one Python class and one YAML file, nothing else."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from ais_lightning.correctors import Corrector, RawCorrection
from tests.integration.helpers import REPO, SMOKE, run_train

pytestmark = pytest.mark.slow


class ScaledWeights(Corrector):
    """A stranger's corrector: every valid token weighs ``scale`` (reported as ``mine/scale``)."""

    def __init__(self, scale: float = 0.5) -> None:
        super().__init__()
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.scale = float(scale)

    def correct(self, delta, mask, advantages, entropy) -> RawCorrection:
        weights = torch.full_like(delta, self.scale)  # [B, T]
        return RawCorrection(weights, mask, torch.zeros_like(mask), {"mine/scale": torch.tensor(self.scale)})


def _user_conf(tmp_path: Path, body: str) -> Path:
    conf = tmp_path / "my_conf"
    (conf / "corrector").mkdir(parents=True)
    (conf / "corrector" / "scaled.yaml").write_text(f"_target_: {__name__}.ScaledWeights\n{body}")
    return conf


def test_a_user_corrector_registered_by_one_yaml_trains_end_to_end(tmp_path: Path):
    conf = _user_conf(tmp_path, "scale: 0.25\n")
    out = tmp_path / "run"
    run_train(
        [
            *SMOKE,
            f"hydra.searchpath=[file://{conf}]",
            "corrector=scaled",
            "logger=csv",
            f"hydra.run.dir={out}",
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO)},
    )
    rows = list(csv.DictReader((out / "csv" / "version_0" / "metrics.csv").open()))
    scales = [float(r["mine/scale"]) for r in rows if r.get("mine/scale")]
    assert scales == [0.25, 0.25], "the corrector ran at every rollout step with the YAML's argument"
    weight_means = [float(r["corrector/weight_mean"]) for r in rows if r.get("corrector/weight_mean")]
    assert weight_means == pytest.approx([0.25, 0.25])
    assert "ScaledWeights" in (out / "config.yaml").read_text()


def test_a_typo_in_a_user_yaml_fails_before_anything_heavy_naming_the_key(tmp_path: Path):
    conf = _user_conf(tmp_path, "scael: 0.25\n")
    with pytest.raises(AssertionError, match=r"corrector\.scael is not an argument"):
        run_train(
            [
                *SMOKE,
                f"hydra.searchpath=[file://{conf}]",
                "corrector=scaled",
                f"hydra.run.dir={tmp_path / 'r'}",
            ],
            cwd=tmp_path,
            env={"PYTHONPATH": str(REPO)},
        )
    assert not (tmp_path / "r" / "checkpoints").exists()
