"""Report on an MLflow sweep (correctors x rollout precisions x seeds): markdown table, PNGs, JSON.

Usage:
  .venv/bin/python tools/sweep_report.py --tracking-uri sqlite:///multirun/.../mlflow.db \\
      --experiment ais-lightning --out reports/sweep1 [--group-by rollout,corrector] \\
      [--metric-map val_accuracy=val/accuracy_trainer] [--plot ais/severity --plot ais/reliability]

Writes into --out: report.md (one row per configuration, seeds averaged: mean ± sample std),
report.json (the same numbers, plus mean histories), and one PNG per metric vs step
(val_accuracy, reward, mismatch_kl, entropy, ais_lambda; skipped with a note when not logged).
Only FINISHED runs are averaged; FAILED/KILLED/RUNNING runs are listed separately.
Column and "gap recovered" definitions: ais_lightning/toolkit/report/stats.py (also printed at the end of report.md).
Repeat --experiment to pool several experiments' runs (e.g. more seeds logged under another name).
Exit status 2 when an experiment does not exist or none has finished runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ais_lightning.toolkit.report import MetricNames, ReportError, build_report


def parse_metric_map(items: list[str]) -> dict[str, str]:
    """``["a=x/y", "b=z,c=w"]`` -> ``{"a": "x/y", "b": "z", "c": "w"}``; ValueError on a bad item."""
    mapping: dict[str, str] = {}
    for item in items:
        for pair in filter(None, (p.strip() for p in item.split(","))):
            name, sep, key = pair.partition("=")
            if not sep or not name.strip() or not key.strip():
                raise ValueError(f"--metric-map expects NAME=METRIC_KEY, got {pair!r}")
            mapping[name.strip()] = key.strip()
    return mapping


def build_parser() -> argparse.ArgumentParser:
    defaults = MetricNames()
    names = ", ".join(f"{f.name}={getattr(defaults, f.name)}" for f in dataclasses.fields(defaults))
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tracking-uri",
        required=True,
        help="MLflow tracking URI: sqlite:///abs/path/mlflow.db, http://127.0.0.1:5000, file:///abs/mlruns",
    )
    parser.add_argument(
        "--experiment",
        required=True,
        action="append",
        help="MLflow experiment name (or numeric id); repeat it to pool the runs of several experiments "
        "into the same rows (e.g. a sweep re-run with other seeds under another experiment name)",
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument(
        "--group-by",
        default=None,
        help="comma-separated params defining a configuration (default: rollout,corrector, the options "
        "picked, when logged, else every param that varies across runs except seed)",
    )
    parser.add_argument(
        "--metric-map",
        action="append",
        default=[],
        metavar="NAME=KEY[,NAME=KEY]",
        help=f"override metric keys (repeatable). Names and defaults: {names}",
    )
    parser.add_argument(
        "--plot",
        action="append",
        default=[],
        metavar="METRIC_KEY",
        help="also plot this logged metric vs step per configuration (repeatable), e.g. ais/severity",
    )
    parser.add_argument(
        "--baseline",
        default="fp32",
        metavar="ROLLOUT",
        help="the rollout option of the full-precision baseline that 'gap recovered' measures against "
        "(default %(default)s; llada_fp32 for the diffusion family)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        names = MetricNames().with_overrides(parse_metric_map(args.metric_map))
    except ValueError as err:
        parser.error(str(err))
    group_by = [k.strip() for k in args.group_by.split(",") if k.strip()] if args.group_by else None
    try:
        report = build_report(
            args.tracking_uri,
            args.experiment,
            args.out,
            group_by=group_by,
            metric_names=names,
            extra_plots=args.plot,
            baseline_precision=args.baseline,
        )
    except ReportError as err:
        print(f"sweep_report: error: {err}", file=sys.stderr)
        return 2
    print(report.markdown.read_text().split("\n## Definitions")[0])
    print(f"wrote {report.markdown}, {report.json}" + "".join(f", {p}" for p in report.plots.values()))
    for name, why in report.skipped_plots.items():
        print(f"skipped plot {name}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
