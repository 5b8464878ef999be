"""tools/diffusion_mismatch.py end to end at toy size (its numbers are not checked here, its contract is)."""

from __future__ import annotations

import json
import math

import pytest

from tests.tools.load_tool import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("diffusion_mismatch")


def test_lr_factor_by_hand(tool):
    assert tool.lr_factor(0, 100, 10) == pytest.approx(0.1)
    assert tool.lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert tool.lr_factor(10, 100, 10) == pytest.approx(1.0)
    assert tool.lr_factor(55, 100, 10) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert tool.lr_factor(100, 100, 10) == pytest.approx(0.1)


@pytest.mark.slow
def test_runs_saves_and_reloads(tool, tmp_path):
    common = [
        "--batch-size", "8", "--eval-prompts", "4", "--samples", "2", "--max-new-tokens", "5",
        "--precisions", "fp32,fp8", "--block-length", "3",
    ]  # fmt: skip
    weights, out = tmp_path / "w.pt", tmp_path / "r.json"
    first = tool.main(["--sft-steps", "2", "--save", str(weights), "--out", str(out), *common])
    assert [(r["remasking"], r["precision"]) for r in first["rows"]] == [
        ("low_confidence", "fp32"),
        ("low_confidence", "fp8"),
        ("random", "fp32"),
        ("random", "fp8"),
    ]
    for row in first["rows"]:
        assert 0 <= row["greedy_accuracy"] <= 1 and row["tokens"] > 0
        if row["precision"] == "fp32":  # the engine's mu is the policy's pi on its own path
            assert row["kl_k3"] == 0 and row["max_abs_dlogp"] <= 1e-5
        else:
            assert row["kl_k3"] > 0
    fp32_sel = first["rows"][0]["seq_dlogp_selection"]
    assert fp32_sel["max"] == 0 and "seq_dlogp_selection" not in first["rows"][2]
    assert json.loads(out.read_text())["rows"] == first["rows"]
    again = tool.main(["--load", str(weights), *common])
    assert again["rows"] == first["rows"]  # the loaded weights reproduce every figure
