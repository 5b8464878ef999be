"""tools/bitbybit_mismatch.py: the clustered KL and its standard error, and a tiny end-to-end run (save, load)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ais_lightning.diagnostics import MismatchKL
from tests.tools.load_tool import load_tool

tool = load_tool("bitbybit_mismatch")


def test_clustered_kl_is_the_token_mean_with_a_ratio_standard_error():
    g = torch.Generator().manual_seed(0)
    mu = -torch.rand(6, 5, generator=g) * 3  # [B, T]
    pi = mu + 0.3 * torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    mask[:, 0] = True
    prompt = torch.tensor([0, 0, 1, 1, 2, 2])
    kl, se = tool.clustered_kl(pi, mu, mask, prompt)
    metric = MismatchKL("k3")
    metric.update(pi, mu, mask)
    assert kl == pytest.approx(float(metric.compute()), rel=1e-6)
    # by hand: per-prompt k3 sums s_p over n_p tokens
    d = (pi - mu).double()
    k3 = torch.where(mask, torch.expm1(d) - d, torch.zeros_like(d))
    s = [float(k3[2 * p : 2 * p + 2].sum()) for p in range(3)]
    n = [float(mask[2 * p : 2 * p + 2].sum()) for p in range(3)]
    ratio = sum(s) / sum(n)
    expected = math.sqrt(3 / 2 * sum((sp - ratio * npp) ** 2 for sp, npp in zip(s, n))) / sum(n)
    assert se == pytest.approx(expected, rel=1e-9)
    assert tool.clustered_kl(mu, mu, mask, prompt) == (0.0, 0.0)  # pi = mu


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
