"""The end-of-run summary of an asynchronous run (text and summary.png) beside a synchronous one's."""

from __future__ import annotations

import math

from ais_lightning.app.summary import format_summary, history_panels, plot_history, summarize

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


def test_the_summary_counts_dropped_rows_and_the_time_the_trainer_waited_for_workers():
    history = [
        {**ASYNC[0], "dropped": 0.0, "rollout_wait_s": 0.5, "worker_restarts": 0.0},
        {**ASYNC[1], "staleness_max": 3.0, "dropped": 4.0, "rollout_wait_s": 1.5, "worker_restarts": 1.0},
    ]
    summary = summarize(history)
    assert summary["staleness_dropped"] == 4.0 and summary["staleness_mean"] == 0.75
    assert summary["staleness_max"] == 3.0  # the stalest row, not the largest mean of a step
    assert summary["rollout_wait_s"] == 2.0 and summary["rollout_wait_per_step_s"] == 1.0
    assert summary["worker_restarts"] == 1.0
    text = format_summary(summary)
    assert (
        "staleness (versions)  mean 0.75, max 3, dropped 4 rows; KL k3 precision 1.00e-03, staleness 1.00e-03"
        in text
    )
    assert "rollout workers       the trainer waited 2.0 s for rollouts (1.00 s per step); restarts 1" in text


def test_a_synchronous_summary_has_neither_line():
    text = format_summary(summarize(SYNC))
    assert "staleness (versions)" not in text and "rollout workers" not in text
    in_process = format_summary(summarize(ASYNC))  # asynchronous without workers: no workers line
    assert "staleness (versions)" in in_process and "rollout workers" not in in_process
