"""Rollout profiling tool: decode costs are per-step differences of two profiled calls (hand values), and
a real tiny run reports rows that add up to its totals."""

from __future__ import annotations

import pytest

from ais_lightning.toolkit.profiling import LOOP_KEY, decode_step_costs, rollup
from tests.tools.load_tool import load_tool


def test_decode_step_costs_subtract_the_prefill_and_divide_by_steps():
    prefill = {"mm": (10.0, 4), "silu": (2.0, 2)}
    full = {"mm": (40.0, 16), "silu": (5.0, 8), "bmm": (9.0, 6)}  # bmm: decode only
    rows = decode_step_costs(prefill, full, steps=3)
    assert rows == [("mm", 10.0, 4.0), ("bmm", 3.0, 2.0), ("silu", 1.0, 2.0)]
    with pytest.raises(ValueError, match="steps"):
        decode_step_costs(prefill, full, steps=0)


def test_tiny_run_reports_consistent_totals(tmp_path):
    tool = load_tool("profile_rollout")
    result = tool.main(["--config", "tiny", "--precision", "fp32", "--new-tokens", "3", "--top", "4"])
    assert result["decode_ms_per_step"] == pytest.approx(sum(ms for _, ms, _ in result["decode"]))
    assert result["prefill_ms"] == pytest.approx(sum(ms for _, ms in result["prefill"]))
    names = {name for name, _, _ in result["decode"]}
    assert "aten::bmm" in names  # the decode step's attention GEMMs
    table = tool.markdown(result, 4)
    assert table.count("| aten::") + table.count("| (all other") >= 5
    with pytest.raises(SystemExit):
        tool.main(["--config", "tiny", "--new-tokens", "1"])


def test_the_model_forward_can_be_profiled(tmp_path):
    tool = load_tool("profile_rollout")
    result = tool.main(
        ["--config", "tiny", "--precision", "fp32", "--new-tokens", "3", "--model-impl", "transformers"]
    )
    assert result["model_impl"] == "transformers"
    assert result["decode_ms_per_step"] == pytest.approx(sum(ms for _, ms, _ in result["decode"]))


def test_rollup_sums_call_chains_over_their_first_functions():
    rows = [("a > b", 3.0, 2.0), ("a", 1.0, 1.0), ("a > c > d", 2.0, 4.0), ("e", 0.5, 1.0)]
    assert rollup(rows, 1) == [("a", 6.0, 1.0), ("e", 0.5, 1.0)]
    assert rollup(rows, 2) == [
        ("a > b", 3.0, 2.0),
        ("a > c", 2.0, 0.0),
        ("a", 1.0, 1.0),
        ("e", 0.5, 1.0),
    ]


def test_decode_step_by_function(tmp_path):
    tool = load_tool("profile_rollout")
    result = tool.main(
        ["--config", "tiny", "--precision", "fp32", "--new-tokens", "3", "--batch", "4", "--functions"]
    )
    rows = result["decode_functions"]
    assert result["decode_functions_ms_per_step"] == pytest.approx(sum(ms for _, ms, _ in rows))
    # only chains entered at every decode step: the prefill's are left out
    assert all(calls > 0 or name == LOOP_KEY for name, _, calls in rows)
    assert "decode step by function" in tool.markdown(result, 5)
