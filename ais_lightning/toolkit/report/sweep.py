"""The whole report in one call: load an MLflow experiment, aggregate it, write markdown, JSON and plots."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ais_lightning.toolkit.report.load import load_runs, split_finished
from ais_lightning.toolkit.report.records import MetricNames, ReportError, RunRecord
from ais_lightning.toolkit.report.render import _slug, plot_metric, report_dict, write_markdown
from ais_lightning.toolkit.report.stats import (
    PER_RUN_PARAMS,
    PLOTTED,
    Row,
    aggregate,
    reference_keys,
    resolve_group_by,
    varying_params,
)


@dataclass
class Report:
    """What ``build_report`` wrote."""

    markdown: Path
    """The markdown report (``report.md``)."""
    json: Path
    """The aggregated numbers (``report.json``)."""
    plots: dict[str, Path]
    """MetricNames field (or extra metric key) -> PNG."""
    skipped_plots: dict[str, str]
    """MetricNames field (or extra metric key) -> why it was not plotted."""
    rows: list[Row]
    """The table rows."""
    excluded: list[RunRecord]
    """Runs not averaged (status other than FINISHED)."""


def build_report(
    tracking_uri: str,
    experiment: str | Sequence[str],
    out_dir: str | Path,
    group_by: list[str] | None = None,
    metric_names: MetricNames | None = None,
    extra_plots: list[str] | None = None,
    *,
    precision_key: str | None = None,
    corrector_key: str | None = None,
    baseline_precision: str = "fp32",
    no_correction: str = "none",
) -> Report:
    """Load, aggregate and write ``report.md``, ``report.json`` and ``<metric>.png`` into ``out_dir``.

    ``experiment``: one MLflow experiment (name or id), or several whose runs are pooled into the same
    rows (e.g. the same sweep run again with other seeds under another ``logger.experiment_name``);
    the report notes a row that holds two runs of one seed.

    ``extra_plots``: further metric keys (e.g. ``ais/severity``) plotted vs step like the
    PLOTTED ones, one PNG each named after the key. ``precision_key`` / ``corrector_key`` (default:
    ``rollout`` / ``corrector``, or the legacy params for older stores): the params whose values ``baseline_precision`` / ``no_correction`` mark the reference rows of the
    gap-recovered column (see :mod:`ais_lightning.toolkit.report.stats`); any other params group as well.
    """
    names = metric_names or MetricNames()
    plotted_keys = {getattr(names, fname) for fname, _, _ in PLOTTED}
    extra = [k for k in dict.fromkeys(extra_plots or []) if k not in plotted_keys]  # each plot once
    experiments = [experiment] if isinstance(experiment, str) else list(dict.fromkeys(experiment))
    if not experiments:
        raise ReportError("no experiment given")
    source = " + ".join(experiments)
    runs = [r for e in experiments for r in load_runs(tracking_uri, e, names, extra_keys=extra)]
    finished, excluded = split_finished(runs, source)
    keys = resolve_group_by(finished, group_by)
    default_precision, default_corrector = reference_keys(keys)
    precision_key = precision_key or default_precision
    corrector_key = corrector_key or default_corrector
    missing = [k for k in keys if not any(k in r.params for r in finished)]
    if missing:
        raise ReportError(f"group-by param(s) {missing} not logged by any finished run of {source!r}")
    rows = aggregate(
        finished,
        keys,
        names,
        precision_key=precision_key,
        corrector_key=corrector_key,
        baseline_precision=baseline_precision,
        no_correction=no_correction,
        extra_keys=extra,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    plots, skipped = _plots(rows, names, extra, out)
    gap_keys = (precision_key, corrector_key, baseline_precision, no_correction)
    notes = _notes(rows, finished, keys, *gap_keys)
    md = write_markdown(
        rows,
        out / "report.md",
        title=f"Sweep report: {source}",
        excluded=excluded,
        group_by=keys,
        plots=plots,
        skipped_plots=skipped,
        notes=notes,
    )
    meta = {
        "experiment": source,
        "experiments": experiments,
        "tracking_uri": tracking_uri,
        "group_by": keys,
        "baseline": {"precision": baseline_precision, "corrector": no_correction},
        "metric_names": dataclasses.asdict(names),
        "plots": {k: p.name for k, p in plots.items()},
        "skipped_plots": skipped,
        "notes": notes,
    }
    js = out / "report.json"
    js.write_text(json.dumps(report_dict(rows, excluded, meta), indent=1))
    return Report(markdown=md, json=js, plots=plots, skipped_plots=skipped, rows=rows, excluded=excluded)


def _plots(
    rows: list[Row], names: MetricNames, extra: list[str], out: Path
) -> tuple[dict[str, Path], dict[str, str]]:
    """One PNG per PLOTTED metric and per ``extra`` key in ``out``: ``(plots, skipped)``, the PNGs by MetricNames
    field (or key) and why the others were not drawn."""
    plots: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    for fname, label, log_y in PLOTTED:
        key = getattr(names, fname)
        png = plot_metric(rows, fname, out / f"{_slug(fname)}.png", ylabel=f"{label} ({key})", log_y=log_y)
        if png is None:
            skipped[fname] = f"metric {key!r} not logged by any finished run"
        else:
            plots[fname] = png
    for key in extra:
        png = plot_metric(rows, key, out / f"{_slug(key)}.png", ylabel=key)
        if png is None:
            skipped[key] = f"metric {key!r} not logged by any finished run"
        else:
            plots[key] = png
    return plots, skipped


def _notes(
    rows: list[Row],
    finished: list[RunRecord],
    keys: list[str],
    precision_key: str,
    corrector_key: str,
    baseline_precision: str,
    no_correction: str,
) -> list[str]:
    """The report's notes: params that differ within a row, rows holding one seed twice, and why there is no
    gap-recovered column when there is none."""
    notes = []
    within = sorted(
        {
            k
            for row in rows
            for k in varying_params([r for r in finished if r.run_id in row.run_ids], PER_RUN_PARAMS)
        }
    )
    if within:
        notes.append(
            f"params that differ within a row (averaged together; add to --group-by to split): {within}"
        )
    if any(len(set(row.seeds)) < len(row.seeds) for row in rows):
        notes.append("some rows hold several runs with the same seed")
    if not any(r.gap_recovered is not None for r in rows):
        if precision_key in keys and corrector_key in keys:
            why = (
                f"it needs {baseline_precision} and {no_correction!r} rows at the same other group values, "
                "and a nonzero gap"
            )
        else:
            why = f"it needs {precision_key!r} and {corrector_key!r} among the group keys"
        notes.append(f"no 'gap recovered' column: {why}")
    return notes
