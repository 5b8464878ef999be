"""All-or-nothing weight sync on a small module: every check runs before the first write."""

import pytest
import torch
from torch import nn

from ais_lightning.quant import QuantLinear
from ais_lightning.rollout.weight_sync import load_validated, requantize, sync_targets, validate_sync


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 3, bias=False)
        self.b = nn.Linear(3, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)


def _snapshot(m):
    return {n: t.clone() for n, t in sync_targets(m).items()}


def test_targets_cover_parameters_and_every_buffer():
    assert sorted(sync_targets(Tiny())) == ["a.weight", "b.bias", "b.weight", "inv_freq", "steps"]


def test_valid_sync_is_cast_and_loaded():
    m = Tiny().to(torch.bfloat16)
    named = [("b.bias", torch.tensor([1.5, -2.0], dtype=torch.float64)), ("steps", torch.tensor(7))]
    load_validated(validate_sync(m, named))
    assert m.b.bias.dtype == torch.bfloat16 and m.b.bias.tolist() == [1.5, -2.0]
    assert int(m.steps) == 7


@pytest.mark.parametrize(
    "bad, match",
    [
        (("nope.weight", torch.zeros(1)), "1 names the engine's model does not have: nope.weight"),
        (("b.weight", torch.zeros(3, 2)), "b.weight has shape \\(3, 2\\), the engine's model has \\(2, 3\\)"),
        (("b.weight", torch.full((2, 3), float("inf"))), "b.weight has 6 non-finite"),
        (("b.weight", [[0.0] * 3] * 2), "b.weight must be a torch.Tensor, got list"),
    ],
)
def test_a_bad_tensor_anywhere_rejects_the_whole_sync(bad, match):
    m = Tiny()
    before = _snapshot(m)
    named = [("a.weight", torch.ones(3, 2)), ("steps", torch.tensor(3)), bad, ("inv_freq", torch.zeros(2))]
    with pytest.raises(ValueError, match=match):
        validate_sync(m, named)
    assert all(torch.equal(before[n], t) for n, t in sync_targets(m).items())  # nothing written


def test_integer_buffers_skip_the_finiteness_check_and_nan_in_float_is_caught_after_cast():
    m = Tiny().half()
    big = torch.full((2,), 1e5)  # finite in float32, inf in float16 (max 65504)
    with pytest.raises(ValueError, match="inv_freq has 2 non-finite value\\(s\\).*torch.float16"):
        validate_sync(m, [("inv_freq", big)])
    validate_sync(m, [("steps", torch.tensor(2**40))])


def test_requantize_refreshes_the_cached_weights():
    q = QuantLinear.from_linear(nn.Linear(4, 4, bias=False), "int8", backend="emulate")
    x = torch.randn(2, 4)
    with torch.no_grad():
        q.weight.data.mul_(3.0)  # through .data: invisible to the layer's own change check
    stale = q(x)
    requantize([q])
    fresh = q(x)
    expected = QuantLinear.from_linear(nn.Linear(4, 4, bias=False), "int8", backend="emulate")
    with torch.no_grad():
        expected.weight.copy_(q.weight)
    expected.refresh()
    assert torch.equal(fresh, expected(x)) and not torch.equal(stale, fresh)
