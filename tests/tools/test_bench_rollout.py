"""Rollout benchmark tool: one real (tiny, 2-token) run writes consistent JSON and a markdown table.

Speed itself is never asserted here (noisy machines); only that the reported ratios are derived
from the reported times of the same run (paired per repeat) and that every requested engine has a row.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.tools.load_tool import load_tool


def _load_tool():
    return load_tool("bench_rollout")


def test_bench_rows_ratios_and_table(tmp_path):
    bench = _load_tool()
    out = tmp_path / "bench.json"
    engines = ["hf-fp32", "torch-fp32", "torch-int8", "torch_hf-int8"]
    result = bench.main(["--config", "tiny", "--engines", *engines, "--new-tokens", "2", "--out", str(out)])

    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"]
    rows = {r["engine"]: r for r in saved["rows"]}
    assert list(rows) == engines
    base, hf = rows["torch-fp32"]["tokens_per_s"], rows["hf-fp32"]["tokens_per_s"]
    for r in rows.values():
        assert r["tokens_per_s"] > 0
        assert r["vs_torch_fp32"] == pytest.approx(r["tokens_per_s"] / base)
        assert r["vs_hf_fp32"] == pytest.approx(r["tokens_per_s"] / hf)
        # ms per step and tokens/s describe the same timing: batch * 1000 / ms_per_step
        assert r["tokens_per_s"] == pytest.approx(saved["shape"]["batch"] * 1000 / r["ms_per_step"])
    assert rows["torch-int8"]["roofline_rate"] == rows["torch_hf-int8"]["roofline_rate"] == "int8"
    assert rows["torch-fp32"]["roofline_rate"] == "fp32"

    table = bench.markdown_table(saved)
    assert table.count("\n| ") == 2 + len(engines)  # header, separator, one line per engine
    assert "| torch-int8 |" in table


def test_paired_speedup_is_the_median_of_per_repeat_ratios():
    bench = _load_tool()
    # the two engines' best times (10 and 4.8) come from different repeats, so best/best (2.08) mixes
    # two machine states; per-repeat ratios are 2.0, 2.0, 2.5.
    assert bench.paired_speedup([10.0, 30.0, 12.0], [5.0, 15.0, 4.8]) == pytest.approx(2.0)
    assert bench.paired_speedup([10.0, 30.0], [5.0, 10.0]) == pytest.approx(
        2.5
    )  # even count: mean of middle two
    with pytest.raises(ValueError, match="one time per repeat"):
        bench.paired_speedup([1.0, 2.0], [1.0])


def test_repeats_pair_ratios_within_each_round(tmp_path):
    bench = _load_tool()
    engines = ["torch-fp32", "torch-int8"]
    result = bench.main(
        [
            "--config",
            "tiny",
            "--engines",
            *engines,
            "--new-tokens",
            "2",
            "--repeats",
            "2",
            "--out",
            str(tmp_path / "b.json"),
        ]
    )
    ref, int8 = result["rows"]
    assert "| n/a |" in bench.markdown_table(result)  # no hf-fp32 row: its ratio column says so
    assert len(ref["seconds"]) == len(int8["seconds"]) == 2
    per_round = [a / b for a, b in zip(ref["seconds"], int8["seconds"])]
    assert int8["vs_torch_fp32"] == pytest.approx(sum(per_round) / 2)
    assert int8["vs_torch_fp32_per_repeat"] == pytest.approx(per_round)
    lo, hi = sorted(per_round)
    table = bench.markdown_table(result)
    assert f"| {sum(per_round) / 2:.2f}x ({lo:.2f}-{hi:.2f}) |" in table
    assert "| 1.00x |" in table  # the reference against itself: no range
    assert int8["tokens_per_s"] == pytest.approx(result["shape"]["batch"] * 2 / min(int8["seconds"]))


def test_vllm_rows_skip_cleanly_without_vllm(tmp_path):
    pytest.importorskip("torch")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; the skip path is for environments without it")
    bench = _load_tool()
    result = bench.main(
        [
            "--config",
            "tiny",
            "--engines",
            "torch-fp32",
            "vllm-fp32",
            "--new-tokens",
            "2",
            "--out",
            str(tmp_path / "b.json"),
        ]
    )
    vllm_row = result["rows"][1]
    assert vllm_row["engine"] == "vllm-fp32" and "vllm" in vllm_row["skipped"].lower()
