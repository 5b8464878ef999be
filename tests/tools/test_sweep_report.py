"""Sweep report: pure aggregation math, and the CLI on a real MLflow SQLite store (and server).

The logged sweep (2 precisions x 2 correctors x 2 seeds + an fp32 baseline, one FAILED and one
RUNNING run) uses values chosen so that every asserted table entry is derived by hand below.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ais_lightning.toolkit.report import (
    MetricNames,
    ReportError,
    RunRecord,
    Stat,
    aggregate,
    format_stat,
    gap_recovered,
    markdown_table,
    mean_history,
    reference_keys,
    resolve_group_by,
    split_finished,
)
from tests.mlflow_server import mlflow_server
from tests.tools.load_tool import load_tool

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "tools" / "sweep_report.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_cli():
    return load_tool("sweep_report")


# ------------------------------------------------------------------------------ the logged sweep
# (precision, corrector, seed) -> validation accuracy at steps 0, 10, 20
ACC = {
    ("fp32", "none", 0): [0.1, 0.5, 0.6],
    ("fp32", "none", 1): [0.2, 0.8, 0.7],
    ("fp8", "none", 0): [0.1, 0.6, 0.4],
    ("fp8", "none", 1): [0.2, 0.5, 0.5],
    ("fp8", "ais", 0): [0.1, 0.3, 0.55],
    ("fp8", "ais", 1): [0.1, 0.3, 0.55],
    ("int8", "none", 0): [0.0, 0.1, 0.2],
    ("int8", "none", 1): [0.0, 0.3, 0.3],
    ("int8", "ais", 0): [0.0, 0.4, 0.4],
    ("int8", "ais", 1): [0.0, 0.5, 0.6],
}
KL_BASE = {"fp32": 1e-6, "fp8": 1e-3, "int8": 1e-2}  # seed 0 logs base*[1, 3], seed 1 base*[2, 4]
STEPS = [0, 10, 20]


def _log_run(client, exp_id, precision, corrector, seed, status="FINISHED", acc=None, summary=True):
    from mlflow.entities import Metric, Param

    run = client.create_run(exp_id, run_name=f"{precision}-{corrector}-s{seed}")
    rid = run.info.run_id
    acc = acc if acc is not None else ACC[(precision, corrector, seed)]
    ts = iter(range(1_000_000, 2_000_000))
    metrics = []

    def hist(key, values, steps=STEPS):
        metrics.extend(Metric(key, float(v), next(ts), s) for s, v in zip(steps, values))

    hist("val/accuracy_engine", acc)
    hist("val/accuracy_trainer", [0.9, 0.9, 0.9])
    # reward/mean ends at 0.5 + seed/5 (seed 0: 0.5, seed 1: 0.7); summary/reward_last differs from it
    hist("reward/mean", [0.1 + seed / 10, 0.3 + seed / 10, 0.5 + seed / 5])
    kl = [1, 3] if seed == 0 else [2, 4]
    hist("mismatch/kl_k3", [KL_BASE[precision] * k for k in kl], steps=[0, 20])
    hist("throughput/rollout_tokens_per_s", [100, 300] if seed == 0 else [300, 500], steps=[0, 20])
    if corrector == "ais":
        hist("ais/lambda", [0.2 + seed / 10, 0.4], steps=[0, 20])
    # no "train/entropy": its plot must be skipped with a note
    if summary:
        metrics.append(Metric("summary/wall_time_s", 60.0 + 20 * seed, next(ts), 20))
        metrics.append(Metric("summary/reward_last", 0.8 + seed / 10, next(ts), 20))
    params = {
        "rollout.precision": precision,
        "corrector.name": corrector,
        "seed": str(seed),
        "task.name": "arithmetic",
        # differs inside the fp32/none row: the report must flag it
        "trainer.lr": "2e-5" if (precision, seed) == ("fp32", 1) else "1e-5",
    }
    client.log_batch(rid, metrics=metrics, params=[Param(k, v) for k, v in params.items()])
    if status != "RUNNING":
        client.set_terminated(rid, status)
    return rid


def _log_sweep(tracking_uri: str) -> dict[str, str]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.create_experiment("sweep")
    for precision, corrector, seed in ACC:
        # int8/ais has no summary metrics: final reward falls back to the last reward/mean value
        _log_run(client, exp, precision, corrector, seed, summary=(precision, corrector) != ("int8", "ais"))
    failed = _log_run(client, exp, "fp8", "ais", 2, status="FAILED", acc=[0.0, 0.0, 0.0])
    running = _log_run(client, exp, "int8", "none", 2, status="RUNNING", acc=[0.0, 0.0, 0.0])
    # the same sweep re-run with another seed under another name, and one seed again: pooled by --experiment x2
    more = client.create_experiment("sweep-more")
    _log_run(client, more, "fp8", "none", 2, acc=[0.3, 0.45, 0.6])
    _log_run(client, more, "int8", "ais", 1)
    only_failed = client.create_experiment("only-failed")
    _log_run(client, only_failed, "fp8", "none", 0, status="FAILED")
    return {"failed": failed, "running": running}


def _table(markdown: str) -> tuple[list[str], list[dict[str, str]]]:
    """The first markdown table: header and one dict per row."""
    lines = [ln for ln in markdown.split("\n## ")[0].splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    return header, rows


def _row(rows, precision, corrector):
    (match,) = [r for r in rows if r["rollout.precision"] == precision and r["corrector.name"] == corrector]
    return match


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The SQLite store with the sweep, and the CLI run on it once in a subprocess."""
    root = tmp_path_factory.mktemp("sweep")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    ids = _log_sweep(uri)
    out = root / "report"
    proc = subprocess.run(
        [sys.executable, str(CLI), "--tracking-uri", uri, "--experiment", "sweep", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    return {"uri": uri, "out": out, "proc": proc, "root": root, **ids}


# ------------------------------------------------------------------------------- CLI, end to end


@pytest.mark.slow
def test_table_values_are_the_hand_computed_means_and_t_intervals(sweep):
    header, rows = _table((sweep["out"] / "report.md").read_text())
    assert header[:3] == ["rollout.precision", "corrector.name", "n seeds"]
    assert len(rows) == 5  # fp32/none, fp8/{none,ais}, int8/{none,ais}
    # two values a, b: sample std |a - b| / sqrt(2), 95% t-interval 12.706 (t, 1 degree of freedom) x std / sqrt(2)
    # = 6.353 |a - b|: 0.1 -> 0.635, 0.2 -> 1.271
    fp8_none = _row(rows, "fp8", "none")
    assert fp8_none["n seeds"] == "2"
    assert fp8_none["final val acc"] == "0.450 ± 0.635"  # 0.4, 0.5
    assert fp8_none["best val acc"] == "0.550 ± 0.635"  # 0.6, 0.5
    assert fp8_none["val acc gain"] == "+0.300 ± 0.000"  # 0.4 - 0.1, 0.5 - 0.2
    assert fp8_none["final reward"] == "0.850 ± 0.635"  # summary/reward_last 0.8, 0.9
    assert fp8_none["mean mismatch KL"] == "2.50e-03 ± 6.35e-03"  # run means 2e-3, 3e-3
    assert fp8_none["rollout tok/s"] == "300.0 ± 1270.6"  # run means 200, 400
    assert fp8_none["wall time/run (s)"] == "70.0 ± 127.1"  # 60, 80
    assert _row(rows, "fp32", "none")["best val acc"] == "0.700 ± 1.271"  # 0.6, 0.8
    assert _row(rows, "fp32", "none")["mean mismatch KL"] == "2.50e-06 ± 6.35e-06"
    assert _row(rows, "int8", "ais")["final val acc"] == "0.500 ± 1.271"  # 0.4, 0.6
    assert _row(rows, "int8", "ais")["val acc gain"] == "+0.500 ± 1.271"  # 0.4 - 0, 0.6 - 0
    # no summary metrics for int8/ais: last reward/mean (0.5, 0.7)
    assert _row(rows, "int8", "ais")["final reward"] == "0.600 ± 1.271"
    # the FAILED fp8/ais seed-2 run (accuracy 0) is not averaged: 0.55, 0.55
    assert _row(rows, "fp8", "ais")["n seeds"] == "2"
    assert _row(rows, "fp8", "ais")["final val acc"] == "0.550 ± 0.000"
    assert _row(rows, "int8", "none")["n seeds"] == "2"  # the RUNNING seed-2 run is not either


@pytest.mark.slow
def test_gap_recovered(sweep):
    _, rows = _table((sweep["out"] / "report.md").read_text())
    # fp8: (0.55 - 0.45) / (0.65 - 0.45) = 0.5; int8: (0.5 - 0.25) / (0.65 - 0.25) = 0.625
    assert _row(rows, "fp8", "ais")["gap recovered"] == "0.500"
    assert _row(rows, "int8", "ais")["gap recovered"] == "0.625"
    assert _row(rows, "fp8", "none")["gap recovered"] == "0.000"
    assert _row(rows, "fp32", "none")["gap recovered"] == "-"
    data = json.loads((sweep["out"] / "report.json").read_text())
    by_cfg = {(r["group"]["rollout.precision"], r["group"]["corrector.name"]): r for r in data["rows"]}
    assert by_cfg[("int8", "ais")]["gap_recovered"] == pytest.approx(0.625)
    assert by_cfg[("fp8", "none")]["final_val_accuracy"]["mean"] == pytest.approx(0.45)
    assert by_cfg[("fp8", "none")]["final_val_accuracy"]["std"] == pytest.approx(0.1 / math.sqrt(2))
    assert by_cfg[("fp8", "none")]["final_val_accuracy"]["half_width"] == pytest.approx(12.7062047 * 0.1 / 2)
    fp8_none = by_cfg[
        ("fp8", "none")
    ]  # every run's value, in the order of its seeds (for paired comparisons)
    assert sorted(fp8_none["final_val_accuracy"]["values"]) == pytest.approx(
        sorted([0.45 - 0.05, 0.45 + 0.05])
    )
    assert len(fp8_none["seeds"]) == len(fp8_none["final_val_accuracy"]["values"]) == 2
    assert by_cfg[("fp32", "none")]["gap_recovered"] is None


@pytest.mark.slow
def test_failed_and_running_runs_are_listed_not_averaged(sweep):
    text = (sweep["out"] / "report.md").read_text()
    excluded = text.split("## Excluded runs")[1].split("\n## ")[0]
    assert sweep["failed"] in excluded and "FAILED" in excluded and "fp8-ais-s2" in excluded
    assert sweep["running"] in excluded and "RUNNING" in excluded
    data = json.loads((sweep["out"] / "report.json").read_text())
    assert {r["run_id"] for r in data["excluded_runs"]} == {sweep["failed"], sweep["running"]}
    averaged = {rid for r in data["rows"] for rid in r["run_ids"]}
    assert sweep["failed"] not in averaged and len(averaged) == 10
    assert "FAILED" in sweep["proc"].stdout
    notes = text.split("## Notes")[1].split("\n## ")[0]
    assert "['trainer.lr']" in notes


@pytest.mark.slow
def test_plots_are_valid_pngs_and_absent_metric_is_skipped(sweep):
    import matplotlib.image

    out = sweep["out"]
    for name in ("val_accuracy", "reward", "mismatch_kl", "ais_lambda"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
        height, width = matplotlib.image.imread(png).shape[:2]
        assert height > 100 and width > 100
    assert not (out / "entropy.png").exists()
    assert "entropy: skipped" in (out / "report.md").read_text()
    assert "skipped plot entropy" in sweep["proc"].stdout
    data = json.loads((out / "report.json").read_text())
    fp8_ais = next(
        r for r in data["rows"] if r["group"] == {"rollout.precision": "fp8", "corrector.name": "ais"}
    )
    # ais/lambda: seed 0 logs [0.2, 0.4], seed 1 [0.3, 0.4] at steps 0, 20
    assert fp8_ais["histories"]["ais_lambda"]["step"] == [0, 20]
    assert fp8_ais["histories"]["ais_lambda"]["mean"] == pytest.approx([0.25, 0.4])
    assert (
        "ais_lambda"
        not in next(r for r in data["rows"] if r["group"]["corrector.name"] == "none")["histories"]
    )


@pytest.mark.slow
def test_group_by_and_metric_map_options(sweep, tmp_path, capsys):
    cli = _load_cli()
    args = ["--tracking-uri", sweep["uri"], "--experiment", "sweep"]
    assert cli.main(args + ["--out", str(tmp_path / "a"), "--group-by", "rollout.precision"]) == 0
    header, rows = _table((tmp_path / "a" / "report.md").read_text())
    assert header[0] == "rollout.precision" and "gap recovered" not in header
    (fp8,) = [r for r in rows if r["rollout.precision"] == "fp8"]
    # 0.4, 0.5, 0.55, 0.55: mean 0.5, deviations -0.1, 0, 0.05, 0.05 -> var 0.015/3 -> std 0.0707; 95% t-interval
    # 3.182 (t, 3 degrees of freedom) x 0.0707 / sqrt(4) = 0.113
    assert fp8["n seeds"] == "4" and fp8["final val acc"] == "0.500 ± 0.113"

    assert (
        cli.main(args + ["--out", str(tmp_path / "b"), "--metric-map", "val_accuracy=val/accuracy_trainer"])
        == 0
    )
    header, rows = _table((tmp_path / "b" / "report.md").read_text())
    assert {r["final val acc"] for r in rows} == {"0.900 ± 0.000"}
    assert "gap recovered" not in header  # fp32 - none = 0: undefined everywhere

    # another rollout as the baseline (the diffusion family's is llada_fp32), recorded in report.json
    assert cli.main(args + ["--out", str(tmp_path / "c"), "--baseline", "fp8"]) == 0
    _, rows = _table((tmp_path / "c" / "report.md").read_text())
    assert _row(rows, "int8", "ais")["gap recovered"] == "1.250"  # (0.5 - 0.25) / (0.45 - 0.25)
    data = json.loads((tmp_path / "c" / "report.json").read_text())
    assert data["baseline"] == {"precision": "fp8", "corrector": "none"}
    capsys.readouterr()


@pytest.mark.slow
def test_several_experiments_pool_their_runs(sweep, tmp_path, capsys):
    cli = _load_cli()
    out = tmp_path / "pooled"
    pooled = ["--experiment", "sweep", "--experiment", "sweep-more"]
    args = ["--tracking-uri", sweep["uri"], "--out", str(out), *pooled]
    assert cli.main(args) == 0
    text = (out / "report.md").read_text()
    _, rows = _table(text)
    fp8_none = _row(rows, "fp8", "none")
    # seeds 0, 1 from "sweep" (final 0.4, 0.5) and seed 2 from "sweep-more" (0.6): mean 0.5, std 0.1, 95%
    # t-interval 4.303 (t, 2 degrees of freedom) x 0.1 / sqrt(3) = 0.248
    assert fp8_none["n seeds"] == "3" and fp8_none["final val acc"] == "0.500 ± 0.248"
    assert fp8_none["val acc gain"] == "+0.300 ± 0.000"  # 0.4 - 0.1, 0.5 - 0.2, 0.6 - 0.3
    assert _row(rows, "fp32", "none")["n seeds"] == "2"  # rows the second experiment lacks are unchanged
    assert "several runs with the same seed" in text  # int8/ais seed 1 is in both
    data = json.loads((out / "report.json").read_text())
    assert data["experiments"] == ["sweep", "sweep-more"] and data["experiment"] == "sweep + sweep-more"
    assert text.startswith("# Sweep report: sweep + sweep-more")
    assert cli.main(args[:-1] + ["no-such-sweep"]) == 2  # any missing experiment is an error
    assert "'no-such-sweep' does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_extra_plots_of_any_logged_metric(sweep, tmp_path, capsys):
    cli = _load_cli()
    out = tmp_path / "extra"
    args = ["--tracking-uri", sweep["uri"], "--experiment", "sweep", "--out", str(out)]
    plots = ["--plot", "val/accuracy_trainer", "--plot", "no/such_metric", "--plot", "ais/lambda"]
    assert cli.main(args + plots) == 0
    assert (out / "report.md").read_text().count("(ais_lambda.png)") == 1  # a PLOTTED metric is plotted once
    assert (out / "val_accuracy_trainer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "no_such_metric.png").exists()
    data = json.loads((out / "report.json").read_text())
    assert "no/such_metric" in data["skipped_plots"]
    for row in data["rows"]:  # every run logged 0.9 at steps 0, 10, 20
        assert row["histories"]["val/accuracy_trainer"]["mean"] == pytest.approx([0.9, 0.9, 0.9])
        assert row["histories"]["val/accuracy_trainer"]["step"] == STEPS
    assert "![val/accuracy_trainer](val_accuracy_trainer.png)" in (out / "report.md").read_text()
    capsys.readouterr()


@pytest.mark.slow
def test_missing_experiment_and_no_finished_runs_are_clear_errors(sweep, tmp_path, capsys):
    cli = _load_cli()
    base = ["--tracking-uri", sweep["uri"], "--out", str(tmp_path)]
    assert cli.main(base + ["--experiment", "no-such-sweep"]) == 2
    err = capsys.readouterr().err
    assert "'no-such-sweep' does not exist" in err and "sweep" in err
    assert cli.main(base + ["--experiment", "only-failed"]) == 2
    err = capsys.readouterr().err
    assert "'only-failed' has no FINISHED runs" in err and "'FAILED': 1" in err
    with pytest.raises(SystemExit):
        cli.main(base + ["--experiment", "sweep", "--metric-map", "accuracy=val/x"])
    assert "unknown metric name" in capsys.readouterr().err


def test_file_store_end_to_end_in_process(tmp_path, monkeypatch, capsys):
    """A small sweep in an MLflow file store (no migrations, so fast): table, exclusion, PNG."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses new file stores otherwise
    from mlflow import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    client = MlflowClient(uri)
    exp = client.create_experiment("small")
    for precision, corrector, seed in [("fp32", "none", 0), ("fp8", "none", 0), ("fp8", "none", 1)]:
        _log_run(client, exp, precision, corrector, seed)
    _log_run(client, exp, "fp8", "ais", 0)
    failed = _log_run(client, exp, "fp8", "ais", 1, status="FAILED", acc=[0.0, 0.0, 0.0])
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # the report opens an existing file store itself
    cli = _load_cli()
    out = tmp_path / "r"
    assert cli.main(["--tracking-uri", uri, "--experiment", "small", "--out", str(out)]) == 0
    _, rows = _table((out / "report.md").read_text())
    assert _row(rows, "fp8", "none")["final val acc"] == "0.450 ± 0.635"
    assert _row(rows, "fp8", "ais")["final val acc"] == "0.550"  # one seed (the FAILED one excluded)
    # (0.55 - 0.45) / (0.6 - 0.45) with fp32 seed 0 only
    assert _row(rows, "fp8", "ais")["gap recovered"] == "0.667"
    assert failed in (out / "report.md").read_text().split("## Excluded runs")[1]
    assert (out / "val_accuracy.png").read_bytes()[:8] == PNG_MAGIC
    capsys.readouterr()


def test_missing_store_is_an_error_not_a_new_store(tmp_path, capsys):
    cli = _load_cli()
    for uri in (f"sqlite:///{tmp_path / 'typo.db'}", (tmp_path / "no_mlruns").as_uri()):
        assert cli.main(["--tracking-uri", uri, "--experiment", "x", "--out", str(tmp_path / "r")]) == 2
        assert "no MLflow store at" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_help_names_every_option():
    proc = subprocess.run([sys.executable, str(CLI), "--help"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0
    for option in (
        "--tracking-uri",
        "--experiment",
        "--out",
        "--group-by",
        "--metric-map",
        "--plot",
        "val/accuracy_engine",
    ):
        assert option in proc.stdout


# ----------------------------------------------------------------------------- pure aggregation


def _record(run_id, params, histories=None, metrics=None, status="FINISHED", start=None, end=None):
    return RunRecord(run_id, run_id, status, params, metrics or {}, histories or {}, start, end)


def test_gap_recovered_formula_and_undefined_cases():
    assert gap_recovered(0.55, 0.45, 0.65) == pytest.approx(0.5)
    assert gap_recovered(0.35, 0.45, 0.65) == pytest.approx(-0.5)
    assert gap_recovered(0.5, 0.6, 0.6) is None
    assert gap_recovered(float("nan"), 0.4, 0.6) is None


def test_format_stat():
    """The mean ± the half-width of its 95% t-interval: 12.706 (t, 1 degree of freedom) x 0.0707 / sqrt(2) = 0.635;
    4.303 (2 degrees of freedom) x 0.1 / sqrt(3) = 0.248; the count when fewer runs than the row's gave it."""
    assert format_stat(Stat(0.45, 0.0707, 2), "{:.3f}") == "0.450 ± 0.635"
    assert format_stat(Stat(0.5, 0.1, 3), "{:.3f}", runs=3) == "0.500 ± 0.248"
    assert format_stat(Stat(0.5, 0.1, 3), "{:+.3f}", runs=5) == "+0.500 ± 0.248 (3)"
    assert format_stat(Stat(0.45, float("nan"), 1), "{:.3f}") == "0.450"
    assert format_stat(Stat(float("nan"), float("nan"), 0), "{:.3f}") == "-"


def test_aggregate_fallbacks_and_non_finite_values():
    names = MetricNames()
    runs = [
        # wall time from start/end (90 s), final reward from the last finite reward/mean (0.4)
        _record("a", {"p": "x", "seed": "0"}, {"reward/mean": [(0, 0.2), (1, 0.4)]}, start=1_000, end=91_000),
        _record(
            "b", {"p": "x", "seed": "1"}, {"reward/mean": [(0, 0.6), (1, float("nan"))]}, start=0, end=30_000
        ),
        _record(
            "c", {"p": "y", "seed": "0"}, {"val/accuracy_engine": [(5, 0.3)]}, {"summary/wall_time_s": 12.0}
        ),
    ]
    rows = aggregate(runs, ["p"], names)
    assert [r.group for r in rows] == [{"p": "x"}, {"p": "y"}]
    x, y = rows
    assert x.stats["wall_time_s"].mean == pytest.approx(60.0)  # 90 s and 30 s
    assert x.stats["final_reward"].mean == pytest.approx(0.5)  # 0.4 and 0.6 (nan step ignored)
    assert x.stats["final_val_accuracy"].n == 0 and "val_accuracy" not in x.histories
    assert y.stats["wall_time_s"].mean == 12.0 and math.isnan(y.stats["wall_time_s"].std)
    assert y.seeds == ["0"] and x.gap_recovered is None


def test_mean_history_over_runs_with_different_steps():
    runs = [
        _record("a", {}, {"k": [(0, 1.0), (10, 3.0)]}),
        _record("b", {}, {"k": [(0, 3.0), (20, 5.0)]}),
    ]
    h = mean_history(runs, "k")
    assert h["step"] == [0, 10, 20]
    assert h["mean"] == [2.0, 3.0, 5.0]
    assert h["n"] == [2, 1, 1]
    assert h["std"][0] == pytest.approx(math.sqrt(2)) and math.isnan(h["std"][1])


def test_gap_recovered_matches_other_group_keys():
    def acc_run(rid, task, precision, corrector, acc):
        params = {"task.name": task, "rollout.precision": precision, "corrector.name": corrector}
        return _record(rid, params, {"val/accuracy_engine": [(0, acc)]})

    runs = [
        acc_run("1", "a", "fp32", "none", 0.8),
        acc_run("2", "a", "fp8", "none", 0.4),
        acc_run("3", "a", "fp8", "tis", 0.7),
        acc_run("4", "b", "fp32", "none", 0.5),
        acc_run("5", "b", "fp8", "tis", 0.5),  # no fp8/none on task b: undefined
    ]
    rows = aggregate(runs, ["task.name", "rollout.precision", "corrector.name"])
    gaps = {tuple(r.group.values()): r.gap_recovered for r in rows}
    assert gaps[("a", "fp8", "tis")] == pytest.approx(0.75)  # (0.7 - 0.4) / (0.8 - 0.4)
    assert gaps[("b", "fp8", "tis")] is None


def test_group_by_resolution_and_status_split():
    runs = [
        _record("a", {"lr": "1", "seed": "0", "task": "t"}),
        _record("b", {"lr": "2", "seed": "1", "task": "t"}),
        _record("c", {"lr": "2", "seed": "1", "task": "t"}, status="FAILED"),
    ]
    assert resolve_group_by(runs) == ["lr"]  # varies; seed excluded; task constant
    assert resolve_group_by(runs, ["task"]) == ["task"]
    assert resolve_group_by(runs + [_record("d", {"corrector.name": "ais"})]) == ["corrector.name"]
    # nothing varies but the seed: one row, no group columns
    same = [_record("a", {"seed": "0", "task": "t"}), _record("b", {"seed": "1", "task": "t"})]
    assert resolve_group_by(same) == []
    (row,) = aggregate(same, [])
    assert row.group == {} and markdown_table([row]).startswith("| n seeds | final val acc |")
    finished, others = split_finished(runs, "e")
    assert [r.run_id for r in finished] == ["a", "b"] and [r.run_id for r in others] == ["c"]
    with pytest.raises(ReportError, match="'e' has no FINISHED runs"):
        split_finished(others, "e")


def test_runs_group_by_the_options_picked_and_by_the_algorithm_when_it_varies():
    def option_run(rid, algorithm, rollout, corrector, acc):
        params = {"algorithm": algorithm, "rollout": rollout, "corrector": corrector, "seed": "0"}
        return _record(rid, params, {"val/accuracy_engine": [(0, acc)]})

    grpo = [
        option_run("1", "grpo", "fp32", "none", 0.8),
        option_run("2", "grpo", "fp4", "none", 0.4),
        option_run("3", "grpo", "fp4", "ais", 0.7),
    ]
    assert resolve_group_by(grpo) == ["rollout", "corrector"]  # one algorithm: no column for it
    assert reference_keys(["rollout", "corrector"]) == ("rollout", "corrector")
    rows = aggregate(grpo, resolve_group_by(grpo))
    assert {tuple(r.group.values()): r.gap_recovered for r in rows}[("fp4", "ais")] == pytest.approx(0.75)
    # a Sol-RL run with corrector=none is its own row, not averaged into GRPO's int8/none
    mixed = [*grpo, option_run("4", "solrl", "fp4", "none", 0.6)]
    assert resolve_group_by(mixed) == ["algorithm", "rollout", "corrector"]
    rows = aggregate(mixed, resolve_group_by(mixed))
    assert len(rows) == 4
    gaps = {tuple(r.group.values()): r.gap_recovered for r in rows}
    assert gaps[("grpo", "fp4", "ais")] == pytest.approx(0.75) and gaps[("solrl", "fp4", "none")] is None
    # stores written before the options were logged group by the legacy params
    assert reference_keys(["rollout.precision", "corrector.name"]) == ("rollout.precision", "corrector.name")


def test_metric_names_overrides_and_cli_metric_map_parsing():
    names = MetricNames().with_overrides({"val_accuracy": "val/accuracy_trainer"})
    assert names.val_accuracy == "val/accuracy_trainer" and names.reward == "reward/mean"
    with pytest.raises(ValueError, match="unknown metric name"):
        MetricNames().with_overrides({"acc": "x"})
    with pytest.raises(ValueError, match="ais_lambda"):
        MetricNames(ais_lambda="")
    cli = _load_cli()
    assert cli.parse_metric_map(["a=x/y,b=z", "c=w"]) == {"a": "x/y", "b": "z", "c": "w"}
    with pytest.raises(ValueError, match="NAME=METRIC_KEY"):
        cli.parse_metric_map(["a"])


# ---------------------------------------------------------------------------- real mlflow server


@pytest.mark.slow
def test_report_from_a_real_mlflow_server(tmp_path, capsys):
    with mlflow_server(tmp_path) as url:
        from mlflow import MlflowClient

        client = MlflowClient(url)
        exp = client.create_experiment("served")
        for precision, corrector, seed in [("fp8", "none", 0), ("fp8", "none", 1), ("fp8", "ais", 0)]:
            _log_run(client, exp, precision, corrector, seed)
        cli = _load_cli()
        assert cli.main(["--tracking-uri", url, "--experiment", "served", "--out", str(tmp_path / "r")]) == 0
        _, rows = _table((tmp_path / "r" / "report.md").read_text())
        assert _row(rows, "fp8", "none")["final val acc"] == "0.450 ± 0.635"
        assert _row(rows, "fp8", "ais")["final val acc"] == "0.550"  # one seed: no ± part
        assert (tmp_path / "r" / "val_accuracy.png").read_bytes()[:8] == PNG_MAGIC
    capsys.readouterr()


def test_line_styles_color_by_last_key_style_by_first():
    from ais_lightning.toolkit.report import LINE_STYLES, Row, _line_styles

    rows = [
        Row({"rollout.precision": p, "corrector.name": c}, [], [], {})
        for p in ("fp4", "fp8", "int8")
        for c in ("ais", "none", "tis")
    ]
    styles = _line_styles(rows)
    by = {(r.group["rollout.precision"], r.group["corrector.name"]): styles[id(r)] for r in rows}
    assert by[("fp4", "ais")][0] == by[("int8", "ais")][0] != by[("fp4", "none")][0]
    assert by[("fp4", "ais")][1] == by[("fp4", "tis")][1] == LINE_STYLES[0]
    assert by[("int8", "ais")][1] == LINE_STYLES[2]
    assert len(set(styles.values())) == len(rows), "every configuration has its own look"
