"""Sweep report: aggregate the MLflow runs of a corrector x precision x seed sweep.

Reads any MLflow experiment (SQLite store, file store or tracking server), groups the finished
runs into configurations (one row per configuration, seeds averaged), and writes a markdown
table, one PNG per metric history and a JSON with the aggregated numbers. One job per module:

- :mod:`ais_lightning.toolkit.report.records`: :class:`RunRecord`, :class:`MetricNames`, :class:`ReportError`;
- :mod:`ais_lightning.toolkit.report.load`: MLflow store -> run records (:func:`load_runs`);
- :mod:`ais_lightning.toolkit.report.stats`: grouping, per-run numbers, means with 95% t-intervals, gap recovered,
  mean histories (:func:`aggregate`; the column definitions are its module docstring);
- :mod:`ais_lightning.toolkit.report.intervals`: Student's t-intervals of a mean, of a difference of means
  (Welch) and of a difference paired by seed;
- :mod:`ais_lightning.toolkit.report.render`: markdown, JSON-able data, plots;
- :mod:`ais_lightning.toolkit.report.sweep`: :func:`build_report`, all of the above in one call.

Grouping is generic: any logged params can be group keys (``group_by``); the gap-recovered column
needs a precision key and a corrector key among them (``rollout.precision`` and ``corrector.name``
by default, see :func:`build_report`).
"""

from ais_lightning.toolkit.report.intervals import (
    CONFIDENCE,
    mean_half_width,
    paired_interval,
    welch_interval,
)
from ais_lightning.toolkit.report.load import check_store_exists, load_runs, split_finished
from ais_lightning.toolkit.report.records import MetricNames, ReportError, RunRecord
from ais_lightning.toolkit.report.render import (
    LINE_STYLES,
    _line_styles,  # noqa: F401  (private, re-exported for tests that import it from here)
    format_stat,
    markdown_table,
    plot_metric,
    report_dict,
    write_markdown,
)
from ais_lightning.toolkit.report.stats import (
    COLUMNS,
    DEFAULT_GROUP_BY,
    LEGACY_GROUP_BY,
    PER_RUN_PARAMS,
    PLOTTED,
    SEED_PARAM,
    Row,
    Stat,
    aggregate,
    gap_recovered,
    mean_history,
    reference_keys,
    resolve_group_by,
    run_values,
    varying_params,
)
from ais_lightning.toolkit.report.sweep import Report, build_report

__all__ = [
    "COLUMNS",
    "CONFIDENCE",
    "DEFAULT_GROUP_BY",
    "LINE_STYLES",
    "PER_RUN_PARAMS",
    "PLOTTED",
    "SEED_PARAM",
    "MetricNames",
    "Report",
    "ReportError",
    "Row",
    "RunRecord",
    "Stat",
    "aggregate",
    "build_report",
    "check_store_exists",
    "format_stat",
    "gap_recovered",
    "load_runs",
    "markdown_table",
    "mean_half_width",
    "mean_history",
    "paired_interval",
    "plot_metric",
    "report_dict",
    "LEGACY_GROUP_BY",
    "reference_keys",
    "resolve_group_by",
    "run_values",
    "split_finished",
    "varying_params",
    "welch_interval",
    "write_markdown",
]
