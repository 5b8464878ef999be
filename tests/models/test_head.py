"""The causal LM head as the model's forward applies it: logit transforms and the probe that checks them."""

import math
from types import SimpleNamespace

import pytest
import torch

from ais_lightning.models.head import LogitTransform, head_mismatch, logit_transform
from tests.architectures import ARCHITECTURES, TRANSFORMED_LOGITS, build

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def test_each_transform_by_hand():
    logits = torch.tensor([0.0, 2.0, -4.0])
    assert LogitTransform().is_identity and torch.equal(LogitTransform()(logits), logits)
    assert LogitTransform(multiply=0.5)(logits).tolist() == [0.0, 1.0, -2.0]
    assert LogitTransform(divide=4.0)(logits).tolist() == [0.0, 0.5, -1.0]
    capped = LogitTransform(softcap=2.0)(logits)  # 2 tanh(x / 2)
    torch.testing.assert_close(capped, torch.tensor([0.0, 2 * math.tanh(1.0), 2 * math.tanh(-2.0)]))
    # multiply, then divide, then cap: 3 * 2 / 4 = 1.5 -> 2 tanh(0.75)
    both = LogitTransform(multiply=3.0, divide=4.0, softcap=2.0)(torch.tensor([2.0]))
    torch.testing.assert_close(both, torch.tensor([2 * math.tanh(0.75)]))


def test_transform_read_from_each_family_config():
    def config(name):
        cls, kwargs = ARCHITECTURES[name]
        return cls(**kwargs)

    assert logit_transform(config("granite")) == LogitTransform(divide=2.0)
    assert logit_transform(config("cohere")) == LogitTransform(multiply=0.5)
    assert logit_transform(config("gemma2")) == LogitTransform(softcap=2.0)
    for name in ("llama", "qwen3", "gpt2", "qwen3_moe"):
        assert logit_transform(config(name)).is_identity, name


@pytest.mark.parametrize("key", ["logits_scaling", "logit_scale", "final_logit_softcapping"])
@pytest.mark.parametrize("value", [0.0, -1.0, "2", True])
def test_a_bad_config_value_names_its_key(key, value):
    with pytest.raises(ValueError, match=f"config.{key} must be a positive number"):
        logit_transform(SimpleNamespace(**{key: value}))


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_the_transform_reproduces_the_model_forward(name):
    model = build(name)
    assert head_mismatch(model, logit_transform(model.config)) < 1e-5
    if name in TRANSFORMED_LOGITS:  # without its transform the head is off by much more than rounding
        assert head_mismatch(model, LogitTransform()) > 1e-2


def test_no_probe_on_the_meta_device():
    from transformers import AutoModelForCausalLM

    cls, kwargs = ARCHITECTURES["granite"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cls(**kwargs))
    assert head_mismatch(model, LogitTransform()) is None
