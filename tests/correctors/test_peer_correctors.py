"""What every corrector of issue #15 shares: the contract on edge cases, and its YAML options.

Each option file ``ais_lightning/app/conf/corrector/<option>.yaml`` names its schema
(``/schema/corrector/<registry name>@_here_``) and sets constructor arguments; here each is built
directly from the registry with those values, so a typo or a wrong value fails without Hydra.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from ais_lightning import ops
from ais_lightning.app.config import CONFIG_DIR
from ais_lightning.correctors import (
    CORRECTORS,
    M2PO,
    PSIS,
    VESPO,
    BatchNormalizedTIS,
    DivergenceRejection,
    DPPOMask,
    IcePop,
    OffPolicySequenceMask,
    build_corrector,
)

CONF = CONFIG_DIR / "corrector"
OPTIONS = {
    "rs_token_k1": "rs",
    "rs_token_k1_token_tis": "rs",
    "rs_seq_sum_k1": "rs",
    "rs_seq_sum_k1_seq_tis": "rs",
    "rs_geo": "rs",
    "rs_geo_token_tis": "rs",
    "rs_k3": "rs",
    "rs_k3_token_tis": "rs",
    "rs_seq_max_k2": "rs",
    "tis_bn": "tis_bn",
    "icepop": "icepop",
    "opsm": "opsm",
    "dppo": "dppo",
    "vespo": "vespo",
    "m2po": "m2po",
    "psis": "psis",
}
"""The YAML options of issue #15 and the registry name each composes."""

NEW = [
    DivergenceRejection(
        token_k1=2.0, seq_mean_k3=0.05, seq_max_k2=2.0, tis_level="token", tis_batch_normalize=True
    ),
    DivergenceRejection(seq_sum_k1=2.0, tis_level="sequence"),
    BatchNormalizedTIS(),
    BatchNormalizedTIS(level="geometric"),
    IcePop(),
    IcePop(level="sequence"),
    OffPolicySequenceMask(0.1),
    DPPOMask(0.05, 0.05),
    VESPO(),
    M2PO(tau=0.01, c_high=3.0),
    PSIS(),
    PSIS(level="sequence"),
]


def option(name: str) -> tuple[str, dict]:
    """(registry name, constructor kwargs) of ``conf/corrector/<name>.yaml``."""
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"))
    defaults = cfg.pop("defaults")
    (schema,) = [d for d in defaults if isinstance(d, str) and d.startswith("/schema/corrector/")]
    assert defaults[-1] == "_self_"
    return schema.removeprefix("/schema/corrector/").removesuffix("@_here_"), cfg


def batch(seed: int, b: int, t: int, scale: float = 0.8):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g) * 4.0 - 0.01
    train = rollout + scale * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.75
    return train, rollout, mask, torch.randn(b, generator=g), torch.rand(b, t, generator=g)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_option_yaml_builds_its_corrector(name):
    registry, kwargs = option(name)
    assert registry == OPTIONS[name]
    corrector = build_corrector(registry, **kwargs)
    assert isinstance(corrector, CORRECTORS[registry])
    header = (CONF / f"{name}.yaml").read_text().splitlines()[0]
    assert header.startswith("# ") and len(header) > 20  # one line: what it is and the peer's name


def test_yaml_values_are_the_presets():
    assert option("rs_k3_token_tis")[1] == {"seq_mean_k3": 0.01, "tis_level": "token"}
    assert option("rs_geo")[1] == {"seq_mean_k1": 1.001, "seq_mean_k1_lower": 0.999}
    assert option("m2po")[1] == {"c_high": 5.0}
    assert option("icepop")[1] == {}  # the defaults are IcePop's (0.5, 5)


def test_registry():
    assert {"rs", "tis_bn", "icepop", "opsm", "dppo", "vespo", "m2po", "psis"} <= set(CORRECTORS)
    assert CORRECTORS["rs"] is DivergenceRejection and CORRECTORS["psis"] is PSIS


@pytest.mark.parametrize("corrector", NEW, ids=lambda c: f"{type(c).__name__}({c.extra_repr()[:30]})")
@pytest.mark.parametrize(("b", "t"), [(5, 8), (0, 4), (3, 0)])
def test_empty_and_degenerate_batches(corrector, b, t):
    train, rollout, mask, adv, ent = batch(0, b, t)
    train = torch.where(mask, train, torch.full_like(train, float("nan")))  # garbage on padding
    for m in (mask, torch.zeros_like(mask)):
        out = corrector(train, rollout, m, advantages=adv, entropy=ent)
        assert out.weights.shape == (b, t) and out.weights.dtype == torch.float32
        assert bool(torch.isfinite(out.weights).all())
        assert bool((out.weights[~m] == 0).all()) and not bool((out.mask & ~m).any())
        assert bool((out.weights >= 0).all())
        assert out.stats and all(isinstance(v, float) and math.isfinite(v) for v in out.stats.values())
        if not m.any():
            assert bool((out.weights == 0).all())


@pytest.mark.parametrize("corrector", NEW, ids=lambda c: type(c).__name__)
def test_on_policy_weights_are_one_and_nothing_is_dropped(corrector):
    _, rollout, mask, adv, _ = batch(1, 6, 9)
    out = corrector(rollout.clone(), rollout, mask, advantages=adv)
    assert torch.equal(out.mask, mask)
    torch.testing.assert_close(out.weights[mask], torch.ones(int(mask.sum())), atol=1e-6, rtol=0)


@pytest.mark.parametrize("corrector", NEW, ids=lambda c: type(c).__name__)
def test_from_log_ratio_equals_forward(corrector):
    train, rollout, mask, adv, ent = batch(2, 6, 9)
    out = corrector(train, rollout, mask, advantages=adv, entropy=ent)
    delta = ops.log_ratio(train, rollout, mask)
    extra = dict(train_logprobs=train, rollout_logprobs=rollout) if isinstance(corrector, DPPOMask) else {}
    again = corrector.from_log_ratio(delta, mask, advantages=adv, entropy=ent, **extra)
    assert torch.equal(out.weights, again.weights) and torch.equal(out.mask, again.mask)
    assert out.stats == again.stats


@pytest.mark.parametrize("corrector", NEW, ids=lambda c: type(c).__name__)
def test_per_token_advantages_equal_broadcast_ones(corrector):
    train, rollout, mask, adv, _ = batch(3, 6, 9)
    a = corrector(train, rollout, mask, advantages=adv)
    b = corrector(train, rollout, mask, advantages=adv[:, None].expand(mask.shape).contiguous())
    assert torch.equal(a.weights, b.weights) and torch.equal(a.mask, b.mask)


@pytest.mark.parametrize("corrector", NEW, ids=lambda c: type(c).__name__)
def test_weights_are_detached(corrector):
    train, rollout, mask, adv, _ = batch(4, 4, 6)
    train.requires_grad_(True)
    out = corrector(train, rollout, mask, advantages=adv)
    assert not out.weights.requires_grad


def test_correctors_that_need_advantages_say_so():
    train, rollout, mask, _, _ = batch(5, 3, 4)
    for corrector in (OffPolicySequenceMask(), DPPOMask(), VESPO()):
        with pytest.raises(ValueError, match="advantages"):
            corrector(train, rollout, mask)
