"""Bad input and bad options raise ValueError naming the culprit; an empty mask gives finite output."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import ais_lightning.correctors
from ais_lightning.correctors import (
    AIS,
    CORRECTORS,
    MIS,
    TIS,
    AISv1,
    CorrectionOutput,
    NoCorrection,
    build_corrector,
)

ALL = [
    NoCorrection(),
    TIS(),
    TIS(level="sequence"),
    MIS(),
    MIS(level="geometric", veto=0.1),
    AIS(),
    AIS(ema_decay=0.9),
    AISv1(),
    AISv1(ema_decay=0.9),
]


def inputs(b: int = 2, t: int = 3):
    train = torch.full((b, t), -1.0)
    rollout = torch.full((b, t), -1.5)
    return train, rollout, torch.ones(b, t, dtype=torch.bool)


@pytest.mark.parametrize("corrector", ALL, ids=lambda c: type(c).__name__)
def test_shape_mismatch_names_the_tensor(corrector):
    train, rollout, mask = inputs()
    with pytest.raises(ValueError, match="rollout_logprobs"):
        corrector(train, rollout[:, :2], mask)
    with pytest.raises(ValueError, match="train_logprobs"):
        corrector(train[:1], rollout, mask)
    with pytest.raises(ValueError, match="entropy"):
        corrector(train, rollout, mask, entropy=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="advantages"):
        corrector(train, rollout, mask, advantages=torch.zeros(3))


@pytest.mark.parametrize("corrector", ALL, ids=lambda c: type(c).__name__)
def test_non_finite_on_valid_tokens(corrector):
    train, rollout, mask = inputs()
    bad = train.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="train_logprobs"):
        corrector(bad, rollout, mask)
    bad_rollout = rollout.clone()
    bad_rollout[0, 0] = -float("inf")
    with pytest.raises(ValueError, match="rollout_logprobs"):
        corrector(train, bad_rollout, mask)
    # The same garbage on a padding token is fine and does not leak into the output.
    mask = mask.clone()
    mask[1, 2] = False
    out = corrector(bad, rollout, mask)
    assert out.weights[1, 2] == 0 and bool(torch.isfinite(out.weights).all())


@pytest.mark.parametrize("corrector", ALL, ids=lambda c: type(c).__name__)
def test_float_mask_is_rejected(corrector):
    train, rollout, mask = inputs()
    with pytest.raises(ValueError, match="mask"):
        corrector(train, rollout, mask.float())


@pytest.mark.parametrize("corrector", ALL, ids=lambda c: type(c).__name__)
def test_integer_logprobs_are_rejected(corrector):
    train, rollout, mask = inputs()
    with pytest.raises(ValueError, match="train_logprobs"):
        corrector(train.long(), rollout, mask)


@pytest.mark.parametrize("corrector", ALL, ids=lambda c: type(c).__name__)
def test_empty_mask_gives_zero_weights_and_finite_stats(corrector):
    train, rollout, mask = inputs()
    out = corrector(
        train, rollout, torch.zeros_like(mask), advantages=torch.ones(2), entropy=torch.ones(2, 3)
    )
    assert isinstance(out, CorrectionOutput)
    assert bool((out.weights == 0).all()) and not bool(out.mask.any())
    assert out.stats and all(isinstance(v, float) and math.isfinite(v) for v in out.stats.values())


@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (lambda: TIS(c_high=2.0, c_low=3.0), "c_low"),
        (lambda: MIS(c_low=2.5, c_high=2.0), "c_low"),
        (lambda: TIS(c_high=0.5), "c_high"),
        (lambda: MIS(c_low=0.2, c_high=0.9), "c_high"),
        (lambda: MIS(c_low=-0.1), "c_low"),
        (lambda: TIS(c_low=1.5, c_high=2.0), "c_low"),
        (lambda: TIS(level="tokens"), "level"),
        (lambda: MIS(level="seq"), "level"),
        (lambda: MIS(veto=0.0), "veto"),
        (lambda: MIS(veto=1.5), "veto"),
        (lambda: AIS(c=0.5), "c must"),
        (lambda: AISv1(kappa=0.0), "kappa"),
        (lambda: AISv1(alpha=-1.0), "alpha"),
        (lambda: AISv1(beta=-1.0), "beta"),
        (lambda: AIS(lambda_min=0.6, lambda_max=0.4), "lambda_min"),
        (lambda: AIS(lambda_max=1.5), "lambda_max"),
        (lambda: AISv1(eps=0.0), "eps"),
        (lambda: AIS(ema_decay=1.0), "ema_decay"),
        (lambda: AIS(fixed_lambda=1.5), "fixed_lambda"),
        (lambda: AIS(c=float("nan")), "c must"),
    ],
)
def test_bad_options_name_the_argument(factory, name):
    with pytest.raises(ValueError, match=name):
        factory()


def test_build_corrector():
    assert isinstance(build_corrector("none"), NoCorrection)
    tis = build_corrector("TIS", level="geometric", c_high=3.0)
    assert isinstance(tis, TIS) and tis.level == "geometric" and tis.c_high == 3.0
    assert isinstance(build_corrector("mis", veto=0.01), MIS)
    assert isinstance(build_corrector("ais", ema_decay=0.5), AIS)
    assert {"none", "tis", "mis", "ais", "ais_v1"} <= set(CORRECTORS)
    with pytest.raises(ValueError, match="unknown corrector 'pis'; registered: .*'ais', 'ais_v1'"):
        build_corrector("pis")


def test_correctors_are_modules_without_lightning():
    # Static check of the package's imports (a subprocess import of torch would take seconds).
    package = Path(ais_lightning.correctors.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in {"lightning", "pytorch_lightning"} for n in names), path
    assert all(isinstance(c, torch.nn.Module) for c in ALL)


@pytest.mark.parametrize("corrector", ALL, ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("shape", [(0, 3), (2, 0), (0, 0)])
def test_zero_size_batches_give_empty_weights_and_finite_stats(corrector, shape):
    """B = 0 or T = 0 (no prompt, or all responses empty) used to crash in a min() over no tokens."""
    zeros = torch.zeros(shape)
    out = corrector(
        zeros, zeros, torch.ones(shape, dtype=torch.bool), advantages=torch.zeros(shape[0]), entropy=zeros
    )
    assert out.weights.shape == shape and out.mask.shape == shape
    assert all(math.isfinite(v) for v in out.stats.values())
