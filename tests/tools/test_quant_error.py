"""Quantization-error tool: one small real run; the numbers it reports are recomputed independently."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from tests.tools.load_tool import load_tool

pytest.importorskip("transformers")


def test_token_kl_matches_a_direct_computation():
    tool = load_tool("quant_error")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    p, q = F.softmax(a.double(), -1), F.softmax(b.double(), -1)
    expected = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(tool.token_kl(a, b), expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(tool.token_kl(a, a), torch.zeros(2, 3, dtype=torch.float64))


def test_outlier_weight_and_relative_mse():
    tool = load_tool("quant_error")
    w = tool.outlier_weight(0, n=16, k=100, frac=0.02, factor=10.0)
    ref = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    scaled = (w != ref).any(0)
    assert scaled.sum() == 2 and torch.allclose(w[:, scaled], 10 * ref[:, scaled])
    from ais_lightning.quant import fake_quantize

    expected = float(((fake_quantize(w, "nint4", "group_e4m3") - w) ** 2).sum() / (w**2).sum())
    assert tool.relative_weight_mse([w], "int4_w") == pytest.approx(expected, rel=1e-6)


def test_one_run_end_to_end(tmp_path, capsys):
    tool = load_tool("quant_error")
    out = tmp_path / "rows.json"
    recipes = "int8_nested,int2,int2_ocs,int2_w"
    result = tool.main(["--batch", "2", "--seq", "6", "--recipes", recipes, "--json", str(out)])
    rows = {r["recipe"]: r for r in result["recipes"]}
    assert list(rows) == recipes.split(",")
    # Per-token activation scales: a sequence's log-probs do not depend on the rest of the batch.
    assert all(r["batch_dep"] == 0.0 for r in rows.values())
    # Weight-only: the model stays a smooth function of its input (a 1-ulp nudge moves log-probs by ~ulps).
    assert rows["int2_w"]["ulp_sens"] < 1e-4
    assert json.loads(out.read_text()) == result
    printed = capsys.readouterr().out
    assert all(f"`{name}`" in printed for name in rows) and "rounding-aware split" in printed
    # Orderings that must hold: 2 bits is far coarser than 8; OCS lowers the outlier-weight error.
    assert rows["int2"]["mse_model"] > 100 * rows["int8_nested"]["mse_model"]
    assert rows["int2"]["kl_mean"] > rows["int8_nested"]["kl_mean"] > 0
    assert rows["int2_ocs"]["mse_outliers"] < 0.5 * rows["int2"]["mse_outliers"]
    # The KL of one recipe, recomputed here from the model and prompts the tool builds.
    from ais_lightning.models import build_tiny_qwen3
    from ais_lightning.quant import quantize_model

    model = build_tiny_qwen3(seed=0).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lp = F.log_softmax(model(ids).logits.double(), -1)
        lq = F.log_softmax(quantize_model(copy.deepcopy(model), "int2")(ids).logits.double(), -1)
    kl = (lq.exp() * (lq - lp)).sum(-1)
    assert rows["int2"]["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-9)
    # E4M3 block scales rounded up avoid the 8-bit clipping of round-to-nearest (measured 3.5x lower).
    rounding = {r["fmt"]: r for r in result["scale_rounding"]}
    assert rounding["nint8"]["up"] < 0.5 * rounding["nint8"]["nearest"]
    # Ablation: rounding-aware never worse than no split here, and better than plain halving at 10%.
    for r in result["ocs_ablation"]:
        assert r["rounding_aware"] <= r["none"]
        if r["ratio"] == 0.1:
            assert r["rounding_aware"] < r["plain"]


def test_nearest_variant_differs_from_group_e4m3_only_by_the_scale_rounding():
    tool = load_tool("quant_error")
    from ais_lightning.quant import fake_quantize

    # Block amaxes that are exact E4M3 multiples of the second level: both roundings agree, bit for bit.
    w = torch.zeros(2, 64)
    w[:, 0], w[:, 32] = 448.0, 8.0
    w[:, 1:32] = torch.linspace(-400, 400, 31)
    assert torch.equal(tool.nearest_e4m3_fake_quantize(w, "nint4"), fake_quantize(w, "nint4", "group_e4m3"))


def test_unknown_recipe_fails_before_any_work():
    tool = load_tool("quant_error")
    with pytest.raises(ValueError, match="unknown quantization recipe"):
        tool.measure(("int4", "int3"), batch=1, seq=2)
