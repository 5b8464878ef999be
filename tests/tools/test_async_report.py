"""tools/async_report.py: per-run values, cells by seed and the paired differences, against hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from tests.tools.load_tool import load_tool

tool = load_tool("async_report")


def test_summarize_each_kind():
    xs = [float(i) for i in range(1, 9)]  # 1 .. 8
    assert tool.summarize(xs, "last") == 8.0
    assert tool.summarize(xs, "mean") == 4.5
    assert tool.summarize(xs, "last50") == 4.5  # fewer than 50 steps: all of them
    assert [tool.summarize(xs, f"quarter{q}") for q in range(1, 5)] == [1.5, 3.5, 5.5, 7.5]
    assert tool.summarize([2.0, 4.0], "quarter1") == 2.0  # a quarter of fewer than one step takes one


def test_cells_and_paired_differences():
    runs = [
        {"params": {"rollout": "int8", "workers": w, "seed": str(s)}, "values": {"acc_trainer": v}}
        for w, s, v in [
            ("ray", 0, 0.9),
            ("ray", 1, 0.8),
            ("ray", 2, 0.7),
            ("-", 0, 0.8),
            ("-", 1, 0.8),
            ("-", 2, 0.5),
        ]
    ]
    table = tool.cells(runs, ["workers", "rollout"])
    assert set(table) == {("ray", "int8"), ("-", "int8")} and set(table["ray", "int8"]) == {"0", "1", "2"}
    d = tool.paired(table["ray", "int8"], table["-", "int8"], "acc_trainer")
    diffs = [0.1, 0.0, 0.2]  # ray - deterministic, seed by seed
    sd = math.sqrt(sum((x - 0.1) ** 2 for x in diffs) / 2)
    assert d["n"] == 3 and d["mean"] == pytest.approx(0.1)
    assert d["se"] == pytest.approx(sd / math.sqrt(3))
    assert d["half_width"] == pytest.approx(4.302653 * sd / math.sqrt(3), rel=1e-5)  # t(2, 0.975)
    assert "> 2 SE" not in tool.show(d)  # 0.1 < 2 x 0.0577


def test_pooled_experiments_pair_by_experiment_and_seed_and_duplicates_are_refused():
    runs = [
        {"experiment": e, "params": {"corrector": c, "seed": str(s)}, "values": {"acc_trainer": v}}
        for e, c, s, v in [
            ("default", "ais", 0, 0.9),
            ("default", "tis", 0, 0.8),
            ("heldout", "ais", 0, 0.5),
            ("heldout", "tis", 0, 0.6),
        ]
    ]
    with pytest.raises(SystemExit, match="share the pairing unit '0'.*--unit experiment,seed"):
        tool.cells(runs, ["corrector"])  # by seed alone the held-out run would hide the default's
    table = tool.cells(runs, ["corrector"], ("experiment", "seed"))
    assert set(table["ais",]) == {"default/0", "heldout/0"}
    d = tool.paired(table["ais",], table["tis",], "acc_trainer")
    assert d["n"] == 2 and d["mean"] == pytest.approx(0.0)  # +0.1 and -0.1
    assert d["se"] == pytest.approx(0.1)  # sd of (0.1, -0.1) = 0.1414, / sqrt(2)
