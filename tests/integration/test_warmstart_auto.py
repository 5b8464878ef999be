"""``warmstart.enabled=auto`` (the default) follows the policy option when ais-train builds a run: the built-in
models start from random weights and are warm-started; a pretrained checkpoint is not (it already answers, and
the default warm start is sized for the built-in model)."""

from __future__ import annotations

import pytest

from ais_lightning.app.build import validate
from ais_lightning.app.config import compose_train_config
from ais_lightning.app.warmstart import WarmStartSettings


def make(*overrides: str):
    return compose_train_config(["output_dir=/tmp/ais-test-unused", *overrides])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), True),  # the built-in tiny Qwen3: random weights
        (("experiment=llada_small",), True),  # the built-in masked-diffusion model
        (("policy=local", "policy.chat_template=true"), False),  # a pretrained checkpoint
    ],
)
def test_auto_follows_the_policy(overrides, expected, tiny_model_dir):
    extra = [f"policy.path={tiny_model_dir}"] if "policy=local" in overrides else []
    cfg = make(*overrides, *extra)
    assert cfg.warmstart.enabled == "auto"  # the default, before validation
    c = validate(cfg)
    assert c.warmstart.enabled is expected and cfg.warmstart.enabled is expected  # the logged config names it


@pytest.mark.parametrize("value", ["true", "false"])
def test_an_explicit_choice_is_kept(value, tiny_model_dir):
    expected = value == "true"
    local = ["policy=local", f"policy.path={tiny_model_dir}"]
    assert validate(make(*local, f"warmstart.enabled={value}")).warmstart.enabled is expected
    assert validate(make(f"warmstart.enabled={value}")).warmstart.enabled is expected
    assert validate(make(*local, "warmstart=disabled")).warmstart.enabled is False


def test_a_policy_spec_without_the_attribute_counts_as_random_weights():
    """A user's own policy spec (``PRETRAINED_WEIGHTS`` left at ``PolicySpec``'s default) keeps the warm start the
    settings ask for."""
    from ais_lightning.app.build import _resolve_warm_start
    from ais_lightning.policy import PolicySpec

    class Spec(PolicySpec):  # a stand-in for a user's policy spec
        def build(self, seed=0):
            raise AssertionError("never built")

    class C:
        policy = Spec()
        warmstart = WarmStartSettings()

    cfg = make()
    _resolve_warm_start(C, cfg)
    assert C.warmstart.enabled is True and cfg.warmstart.enabled is True


@pytest.mark.parametrize("bad", ["yes", "1", "Auto"])
def test_a_bad_value_names_the_field(bad):
    with pytest.raises(ValueError, match=r"enabled must be true, false or auto"):
        validate(make(f"warmstart.enabled={bad}"))
    with pytest.raises(ValueError, match=r"WarmStartSettings.enabled must be true, false or auto, got 2"):
        WarmStartSettings(enabled=2)
