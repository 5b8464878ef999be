"""Linear-kernel benchmark tool: every variant computes the same linear (speed is never asserted)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.tools.load_tool import load_tool


@pytest.mark.parametrize(
    "recipe, backend, tol", [(None, "onednn", 1e-4), ("int8", "int8", 0.05), ("int8", "fbgemm", 0.05)]
)
def test_variants_compute_the_linear(recipe, backend, tol):
    bench = load_tool("bench_quant")
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(8, 64)
    layer = bench.build_variant(linear, recipe, backend, batch=8)
    if layer is None:
        pytest.skip(f"this torch build or CPU has no {backend}")
    with torch.inference_mode():
        ref = linear(x)
        out = layer(x)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= tol * ref.abs().max().item()
