"""The end-of-run plot (summary.png): its panels for a synchronous and an asynchronous history, and the PNG."""

from __future__ import annotations

import math

from ais_lightning.app.summary import history_panels, plot_history

SYNC = [{"step": 1.0, "reward": 0.2, "kl_k3": 1e-3, "entropy": 2.0, "lambda": 0.5}]
ASYNC = [
    {**SYNC[0], "staleness": 0.0, "staleness_bound": 2.0, "kl_k3_precision": 1e-3, "kl_k3_staleness": 0.0},
    {
        "step": 2.0,
        "reward": 0.3,
        "kl_k3": 3e-3,
        "entropy": 1.9,
        "lambda": 0.6,
        "staleness": 1.5,
        "staleness_bound": 2.0,
        "kl_k3_precision": 1e-3,
        "kl_k3_staleness": 2e-3,
    },
]


def test_a_synchronous_run_plots_four_panels_of_one_line():
    panels = history_panels(SYNC)
    assert [title for title, _ in panels] == ["reward", "mismatch KL (k3)", "entropy", "AIS lambda"]
    assert all(len(lines) == 1 for _, lines in panels)
    assert panels[1][1] == {"whole": [1e-3]}


def test_an_asynchronous_run_adds_the_kl_parts_and_the_staleness_against_its_bound():
    panels = dict(history_panels(ASYNC))
    assert panels["mismatch KL (k3)"] == {
        "whole": [1e-3, 3e-3],
        "precision": [1e-3, 1e-3],
        "staleness": [0.0, 2e-3],
    }
    assert panels["staleness (versions)"] == {"mean": [0.0, 1.5], "bound": [2.0, 2.0]}


def test_a_step_without_a_value_is_a_gap_and_the_png_is_written(tmp_path):
    history = [*ASYNC, {"step": 3.0, "reward": 0.4}]  # e.g. a step whose metrics were not all logged
    panels = dict(history_panels(history))
    assert math.isnan(panels["staleness (versions)"]["mean"][2])
    png = plot_history(history, tmp_path / "summary.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_history([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
