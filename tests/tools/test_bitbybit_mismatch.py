"""tools/bitbybit_mismatch.py: a tiny end-to-end run (save, load) through ais-train's run builder."""

from __future__ import annotations

import json

import pytest

from tests.tools.load_tool import load_tool

tool = load_tool("bitbybit_mismatch")


def test_a_tiny_run_saves_a_warm_start_that_loads_to_the_same_numbers(tmp_path):
    common = ["--eval-prompts", "4", "--precisions", "fp32,int4_w", "--max-new-tokens", "4"]
    saved, loaded = tmp_path / "saved.json", tmp_path / "loaded.json"
    ws = tmp_path / "ws"
    args = ["--sft-steps", "2", "--band", "none", "--batch-size", "4", "--cache-dir", str(tmp_path / "c")]
    args += ["--save", str(ws), "--json", str(saved)]
    assert tool.main([*common, *args]) == 0
    assert (ws / "config.json").exists() and json.loads((ws / "warmstart.json").read_text())["sft_steps"] == 2
    assert tool.main([*common, "--load", str(ws), "--json", str(loaded)]) == 0
    a, b = json.loads(saved.read_text())["rows"], json.loads(loaded.read_text())["rows"]
    assert [r["precision"] for r in a] == ["fp32", "int4_w"]
    assert a[0]["kl_k3"] < 1e-9 < a[1]["kl_k3"]  # the fp32 engine is the policy; int4 weights are not
    assert a[1]["kl_k3_aligned"] < 1e-9  # a weight-only aligned trainer computes what the engine computes
    for x, y in zip(a, b):
        assert x["kl_k3"] == pytest.approx(y["kl_k3"], rel=1e-4, abs=1e-10)
        assert x["greedy_accuracy"] == y["greedy_accuracy"]
