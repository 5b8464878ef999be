"""Progressive precision schedule: step -> recipe, switching a quantized model in place."""

import pytest
import torch
from torch import nn

from ais_lightning.quant import PrecisionSchedule, QuantLinear, get_recipe, quantize_model


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))


def test_recipe_at_step_boundaries():
    sched = PrecisionSchedule([(0, "int8_nested"), (100, "int4"), (250, "int2")])
    names = [sched.recipe_at(s).name for s in (0, 99, 100, 101, 249, 250, 10**9)]
    assert names == ["int8_nested", "int8_nested", "int4", "int4", "int4", "int2", "int2"]
    assert [sched.stage_at(s) for s in (0, 100, 250)] == [0, 1, 2] and len(sched) == 3
    assert repr(sched) == "PrecisionSchedule([(0, 'int8_nested'), (100, 'int4'), (250, 'int2')])"
    assert sched.recipe_at(100) is get_recipe("int4")


def test_progressive_builder():
    sched = PrecisionSchedule.progressive(50, weight_only=True, ocs_ratio=0.05)
    assert sched.starts == (0, 50, 100)
    assert [r.name for r in sched.recipes] == ["int8_nested_w_ocs", "int4_w_ocs", "int2_w_ocs"]
    assert PrecisionSchedule.progressive(10, bits=(4, 2)).recipes[1] == get_recipe("int2")


def test_apply_switches_only_when_the_stage_changes():
    model = quantize_model(_model(), "int8_nested", skip=[])
    weights = [p.detach().clone() for p in model.parameters()]
    sched = PrecisionSchedule([(0, "int8_nested"), (10, "int4"), (20, "int2")])
    x = torch.randn(3, 64)
    assert sched.apply(model, 0) is False  # already int8_nested
    assert sched.apply(model, 10) is True
    assert {m.recipe.name for m in model.modules() if isinstance(m, QuantLinear)} == {"int4"}
    assert sched.apply(model, 15) is False
    with torch.no_grad():
        expected = quantize_model(_model(), "int4", skip=[])(x)
        assert torch.equal(model(x), expected)
    assert sched.apply(model, 25) is True and model[0].recipe.name == "int2"
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))  # masters untouched


def test_apply_to_some_layers_only():
    model = quantize_model(_model(), "int8_nested", skip=[])
    sched = PrecisionSchedule([(0, "int8_nested"), (5, "int2_w")], names=["2"])  # the second Linear ("2")
    assert sched.apply(model, 5) is True
    assert (model[0].recipe.name, model[2].recipe.name) == ("int8_nested", "int2_w")
    with pytest.raises(ValueError, match="no QuantLinear layers matching"):
        PrecisionSchedule([(0, "int4")], names=["nope"]).apply(model, 0)
    with pytest.raises(ValueError, match="quantize it first"):
        PrecisionSchedule([(0, "int4")]).apply(_model(), 0)


@pytest.mark.parametrize(
    "stages, match",
    [
        ([], "non-empty"),
        ("int4", "non-empty"),
        ([(5, "int4")], "start at step 0"),
        ([(0, "int8_nested"), (0, "int4")], "increase strictly"),
        ([(0, "int8_nested"), (-1, "int4")], "start_step must be an int >= 0"),
        ([(0, "int4", 3)], "pair"),
        ([(0.0, "int4")], "start_step must be an int"),
        ([(0, "int3")], "unknown quantization recipe"),
    ],
)
def test_bad_stages_raise(stages, match):
    with pytest.raises(ValueError, match=match):
        PrecisionSchedule(stages)


def test_bad_steps_and_arguments_raise():
    sched = PrecisionSchedule([(0, "int4")])
    for step in (-1, 1.5, True):
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            sched.recipe_at(step)
    with pytest.raises(ValueError, match="steps_per_stage"):
        PrecisionSchedule.progressive(0)
    with pytest.raises(ValueError, match="names must be a list"):
        PrecisionSchedule([(0, "int4")], names="layers.0")
