"""Sweep report: aggregate the MLflow runs of a corrector x precision x seed sweep.

Reads any MLflow experiment (SQLite store, file store or tracking server), groups the finished
runs into configurations (one row per configuration, seeds averaged), and writes a markdown
table, one PNG per metric history and a JSON with the aggregated numbers.

Definitions used in the table (per run first, then mean ± sample std (ddof=1) over the runs of a
configuration; the std is omitted when a configuration has a single run; metric keys are the
defaults, see ``metric_names`` in report.json for the ones actually read):

- final / best validation accuracy: the value at the highest logged step / the maximum over steps;
- val acc gain: final minus first (lowest-step) validation accuracy of the same run, so a spread
  of starting points across seeds (e.g. seed-dependent warm starts) cancels; needs >= 2 values;
- final reward: ``summary/reward_last`` when logged, else the last ``reward/mean``;
- mismatch KL, rollout tokens/s: the mean over all logged steps of the run;
- wall time: ``summary/wall_time_s`` when logged, else the run's end time - start time;
- gap recovered (the "how much of the low-precision accuracy loss does a corrector win back"
  measure of the AIS paper, arXiv 2605.13907, and FP8-RL, arXiv 2601.18150)::

      (acc - acc_none_same_precision) / (acc_fp32 - acc_none_same_precision)

  with ``acc`` the configuration's mean final validation accuracy, ``acc_none_same_precision``
  that of the uncorrected run at the same rollout precision and ``acc_fp32`` that of the fp32
  baseline (corrector ``none`` when present), all other group keys equal. 1 = the full fp32
  accuracy is recovered, 0 = no better than no correction, < 0 = worse. Left empty for the
  baseline precision itself, when either reference row is missing, or when the gap is 0.

Non-finite values in a metric history are ignored in the per-run reductions. Runs whose status
is not FINISHED (FAILED, KILLED, RUNNING, ...) are never averaged: they are listed separately.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

DEFAULT_GROUP_BY = ("rollout.precision", "corrector.name")
"""Group keys used when present in the runs' params (else: every param that varies, except ``seed``)."""

SEED_PARAM = "seed"
PER_RUN_PARAMS = (SEED_PARAM, "output_dir", "ckpt_path", "logger.run_name")
"""Params that differ between runs of one configuration by construction; never grouped on."""


class ReportError(ValueError):
    """The experiment cannot be reported on (missing, no finished runs, bad options)."""


@dataclass
class MetricNames:
    """MLflow metric keys the report reads; defaults are what ``ais-train`` logs."""

    val_accuracy: str = "val/accuracy_engine"
    """Validation accuracy per validation step (final/best columns, gap recovered, plot)."""
    reward: str = "reward/mean"
    """Mean rollout reward per training step (plot; final reward fallback)."""
    reward_final: str = "summary/reward_last"
    """End-of-run reward summary; preferred over the last ``reward`` value when logged."""
    mismatch_kl: str = "mismatch/kl_k3"
    """Rollout/trainer mismatch KL per step (mean column, plot)."""
    entropy: str = "train/entropy"
    """Trainer token entropy per step (plot)."""
    ais_lambda: str = "ais/lambda"
    """AIS mixing coefficient per step (plot; absent for non-AIS runs)."""
    tokens_per_s: str = "throughput/rollout_tokens_per_s"
    """Rollout throughput per step (mean column)."""
    wall_time: str = "summary/wall_time_s"
    """Wall time of the whole run in seconds; falls back to the run's end - start time."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"MetricNames.{f.name} must be a non-empty metric key, got {value!r}")

    def with_overrides(self, mapping: dict[str, str]) -> MetricNames:
        """A copy with ``{field: metric_key}`` replaced; unknown fields raise ValueError."""
        valid = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(mapping) - set(valid))
        if unknown:
            raise ValueError(f"unknown metric name(s) {unknown}; expected some of {valid}")
        return dataclasses.replace(self, **mapping)


PLOTTED = (
    ("val_accuracy", "validation accuracy", False),
    ("reward", "reward", False),
    ("mismatch_kl", "mismatch KL", True),
    ("entropy", "entropy", False),
    ("ais_lambda", "AIS lambda", False),
)
"""(MetricNames field, axis label, log y-axis) of the metrics plotted vs step, one PNG each
(mismatch KL spans decades across precisions: FP8 ~1e-3, int8/FP4 ~1e-2, fp32 ~0)."""


@dataclass
class RunRecord:
    """One MLflow run as the report sees it."""

    run_id: str
    """MLflow run id."""
    run_name: str
    """MLflow run name (may be empty)."""
    status: str
    """MLflow run status: FINISHED, FAILED, KILLED, RUNNING or SCHEDULED."""
    params: dict[str, str]
    """Logged params (the flattened resolved Hydra config for ``ais-train`` runs)."""
    metrics: dict[str, float]
    """Latest value of every logged metric."""
    histories: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """``metric key -> [(step, value), ...]`` sorted by step, one value per step (the last logged)."""
    start_time_ms: int | None = None
    """Run start, ms since the epoch."""
    end_time_ms: int | None = None
    """Run end, ms since the epoch (None while running)."""


@dataclass
class Stat:
    """Mean and sample standard deviation of one quantity over the runs of a configuration."""

    mean: float
    """Mean over the runs that have the quantity (nan if none has it)."""
    std: float
    """Sample std (ddof=1); nan with fewer than 2 values."""
    n: int
    """Number of runs that contributed."""


@dataclass
class Row:
    """One configuration of the sweep (a table row)."""

    group: dict[str, str]
    """Group key -> value (a missing param reads ``"-"``)."""
    run_ids: list[str]
    """The FINISHED runs averaged in this row."""
    seeds: list[str]
    """Their ``seed`` params (``"?"`` when not logged)."""
    stats: dict[str, Stat]
    """Column name -> mean/std over the runs (see COLUMNS)."""
    histories: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """MetricNames field -> ``{"step": [...], "mean": [...], "std": [...]}`` over the runs."""
    gap_recovered: float | None = None
    """See the module docstring; None when undefined."""


COLUMNS = (
    ("final_val_accuracy", "final val acc", "{:.3f}"),
    ("best_val_accuracy", "best val acc", "{:.3f}"),
    ("val_accuracy_gain", "val acc gain", "{:+.3f}"),
    ("final_reward", "final reward", "{:.3f}"),
    ("mean_mismatch_kl", "mean mismatch KL", "{:.2e}"),
    ("rollout_tokens_per_s", "rollout tok/s", "{:.1f}"),
    ("wall_time_s", "wall time/run (s)", "{:.1f}"),
)
"""(stat name, markdown header, number format) of the aggregated columns."""


# ----------------------------------------------------------------------------------------- loading


def _client(tracking_uri: str) -> Any:
    """An MlflowClient. An existing file store (``file:///...`` or a bare path: where older sweeps
    live) is opened although MLflow >= 3 refuses file stores unless ``MLFLOW_ALLOW_FILE_STORE``."""
    from mlflow import MlflowClient

    if "://" in tracking_uri and not tracking_uri.startswith("file:"):
        return MlflowClient(tracking_uri=tracking_uri)
    previous = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        return MlflowClient(tracking_uri=tracking_uri)  # the store is built (and cached) here
    finally:
        if previous is None:
            del os.environ["MLFLOW_ALLOW_FILE_STORE"]
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = previous


def check_store_exists(tracking_uri: str) -> None:
    """ReportError when a local store (``sqlite:///path``, ``file:///path`` or a bare path) is
    missing: opening it would silently create an empty one (and, for SQLite, run migrations)."""
    if tracking_uri.startswith("sqlite:///"):
        path = Path(unquote(tracking_uri.removeprefix("sqlite:///")))
    elif tracking_uri.startswith("file:"):
        path = Path(unquote(urlparse(tracking_uri).path))
    elif "://" not in tracking_uri:
        path = Path(tracking_uri)
    else:
        return
    if not path.exists():
        raise ReportError(f"no MLflow store at {path} (tracking URI {tracking_uri})")


def _find_experiment(client: Any, experiment: str, tracking_uri: str) -> Any:
    exp = client.get_experiment_by_name(experiment)
    if exp is None and experiment.isdigit():
        from mlflow.exceptions import MlflowException

        try:
            exp = client.get_experiment(experiment)
        except MlflowException:  # no experiment with that id
            exp = None
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ReportError(
            f"experiment {experiment!r} does not exist at {tracking_uri} (experiments there: {names})"
        )
    return exp


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        # several values at one step: keep the one logged last
        if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
            by_step[m.step] = (m.timestamp, float(m.value))
    return [(step, by_step[step][1]) for step in sorted(by_step)]


def load_runs(
    tracking_uri: str,
    experiment: str,
    metric_names: MetricNames | None = None,
    extra_keys: tuple[str, ...] | list[str] = (),
) -> list[RunRecord]:
    """All active runs of ``experiment`` (by name, or by id) at ``tracking_uri``, any status.

    Histories are fetched with ``MlflowClient.get_metric_history`` for every metric in
    ``metric_names`` and ``extra_keys`` that the run logged. Raises ReportError when the store or
    the experiment does not exist.
    """
    names = metric_names or MetricNames()
    check_store_exists(tracking_uri)
    client = _client(tracking_uri)
    exp = _find_experiment(client, experiment, tracking_uri)
    wanted = {getattr(names, f.name) for f in dataclasses.fields(names)} | set(extra_keys)
    records: list[RunRecord] = []
    token = None
    while True:
        page = client.search_runs([exp.experiment_id], max_results=1000, page_token=token)
        for run in page:
            metrics = dict(run.data.metrics)
            records.append(
                RunRecord(
                    run_id=run.info.run_id,
                    run_name=run.info.run_name or "",
                    status=run.info.status,
                    params=dict(run.data.params),
                    metrics=metrics,
                    histories={
                        k: _history(client, run.info.run_id, k) for k in sorted(wanted & set(metrics))
                    },
                    start_time_ms=run.info.start_time,
                    end_time_ms=run.info.end_time,
                )
            )
        token = page.token
        if not token:
            break
    records.sort(key=lambda r: (r.start_time_ms or 0, r.run_id))
    return records


def split_finished(runs: list[RunRecord], experiment: str = "") -> tuple[list[RunRecord], list[RunRecord]]:
    """(FINISHED runs, all others). Raises ReportError naming ``experiment`` if none finished."""
    finished = [r for r in runs if r.status == "FINISHED"]
    others = [r for r in runs if r.status != "FINISHED"]
    if not finished:
        counts = {s: sum(r.status == s for r in others) for s in sorted({r.status for r in others})}
        raise ReportError(f"experiment {experiment!r} has no FINISHED runs (other runs by status: {counts})")
    return finished, others


# ------------------------------------------------------------------------------------- aggregation


def resolve_group_by(runs: list[RunRecord], group_by: list[str] | None = None) -> list[str]:
    """``group_by`` if given; else DEFAULT_GROUP_BY keys present in any run; else every varying
    param except ``seed``."""
    if group_by:
        return list(group_by)
    present = [k for k in DEFAULT_GROUP_BY if any(k in r.params for r in runs)]
    return present or varying_params(runs, exclude=PER_RUN_PARAMS)


def varying_params(runs: list[RunRecord], exclude: tuple[str, ...] = ()) -> list[str]:
    """Params whose value (or presence) differs across ``runs``, sorted, minus ``exclude``."""
    keys = sorted({k for r in runs for k in r.params} - set(exclude))
    return [k for k in keys if len({r.params.get(k) for r in runs}) > 1]


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _stat(values: list[float]) -> Stat:
    vals = _finite(values)
    if not vals:
        return Stat(float("nan"), float("nan"), 0)
    std = statistics.stdev(vals) if len(vals) > 1 else float("nan")
    return Stat(statistics.fmean(vals), std, len(vals))


def run_values(run: RunRecord, names: MetricNames) -> dict[str, float]:
    """The per-run numbers behind COLUMNS (nan when the run did not log the metric)."""
    nan = float("nan")

    def hist(key: str) -> list[float]:
        return _finite([v for _, v in run.histories.get(key, [])])

    acc = hist(names.val_accuracy)
    rewards = hist(names.reward)
    kl = hist(names.mismatch_kl)
    tps = hist(names.tokens_per_s)
    if names.reward_final in run.metrics:
        final_reward = run.metrics[names.reward_final]
    else:
        final_reward = rewards[-1] if rewards else nan
    if names.wall_time in run.metrics:
        wall = run.metrics[names.wall_time]
    elif run.start_time_ms is not None and run.end_time_ms is not None:
        wall = (run.end_time_ms - run.start_time_ms) / 1000.0
    else:
        wall = nan
    return {
        "final_val_accuracy": acc[-1] if acc else nan,
        "best_val_accuracy": max(acc) if acc else nan,
        "val_accuracy_gain": acc[-1] - acc[0] if len(acc) > 1 else nan,
        "final_reward": final_reward,
        "mean_mismatch_kl": statistics.fmean(kl) if kl else nan,
        "rollout_tokens_per_s": statistics.fmean(tps) if tps else nan,
        "wall_time_s": wall,
    }


def mean_history(runs: list[RunRecord], key: str) -> dict[str, list[float]]:
    """Mean and sample std over ``runs`` at every step any run logged ``key`` (std nan for 1 value)."""
    per_step: dict[int, list[float]] = {}
    for run in runs:
        for step, value in run.histories.get(key, []):
            if math.isfinite(value):
                per_step.setdefault(step, []).append(value)
    out: dict[str, list[float]] = {"step": [], "mean": [], "std": [], "n": []}
    for step in sorted(per_step):
        s = _stat(per_step[step])
        out["step"].append(step)
        out["mean"].append(s.mean)
        out["std"].append(s.std)
        out["n"].append(s.n)
    return out


def aggregate(
    runs: list[RunRecord],
    group_by: list[str],
    metric_names: MetricNames | None = None,
    precision_key: str = "rollout.precision",
    corrector_key: str = "corrector.name",
    baseline_precision: str = "fp32",
    no_correction: str = "none",
    extra_keys: tuple[str, ...] | list[str] = (),
) -> list[Row]:
    """One Row per distinct ``group_by`` value tuple of the (FINISHED) ``runs``, sorted by it
    (an empty ``group_by`` gives a single row). ``row.histories`` holds the PLOTTED metrics under
    their MetricNames field and every ``extra_keys`` metric under its own key.

    The gap-recovered value is filled when both ``precision_key`` and ``corrector_key`` are group
    keys (see the module docstring).
    """
    if not runs:
        raise ValueError("runs is empty: nothing to aggregate")
    names = metric_names or MetricNames()
    groups: dict[tuple[str, ...], list[RunRecord]] = {}
    for run in runs:
        groups.setdefault(tuple(run.params.get(k, "-") for k in group_by), []).append(run)
    rows = []
    for key in sorted(groups):
        members = groups[key]
        per_run = [run_values(r, names) for r in members]
        stats = {col: _stat([v[col] for v in per_run]) for col, _, _ in COLUMNS}
        histories = {fname: mean_history(members, getattr(names, fname)) for fname, _, _ in PLOTTED}
        histories.update({key: mean_history(members, key) for key in extra_keys})
        rows.append(
            Row(
                group=dict(zip(group_by, key)),
                run_ids=[r.run_id for r in members],
                seeds=[r.params.get(SEED_PARAM, "?") for r in members],
                stats=stats,
                histories={k: h for k, h in histories.items() if h["step"]},
            )
        )
    if precision_key in group_by and corrector_key in group_by:
        _fill_gap_recovered(rows, precision_key, corrector_key, baseline_precision, no_correction)
    return rows


def gap_recovered(acc: float, acc_none: float, acc_fp32: float) -> float | None:
    """(acc - acc_none) / (acc_fp32 - acc_none); None if undefined (zero gap or a nan input)."""
    gap = acc_fp32 - acc_none
    if not all(math.isfinite(x) for x in (acc, acc_none, acc_fp32)) or gap == 0:
        return None
    return (acc - acc_none) / gap


def _fill_gap_recovered(
    rows: list[Row], precision_key: str, corrector_key: str, baseline_precision: str, no_correction: str
) -> None:
    def context(row: Row) -> tuple[tuple[str, str], ...]:
        return tuple((k, v) for k, v in row.group.items() if k not in (precision_key, corrector_key))

    def acc(row: Row) -> float:
        return row.stats["final_val_accuracy"].mean

    for row in rows:
        if row.group[precision_key] == baseline_precision:
            continue
        same = [r for r in rows if context(r) == context(row)]
        none_rows = [
            r
            for r in same
            if r.group[precision_key] == row.group[precision_key] and r.group[corrector_key] == no_correction
        ]
        base_rows = [r for r in same if r.group[precision_key] == baseline_precision]
        preferred = [r for r in base_rows if r.group[corrector_key] == no_correction]
        base_rows = preferred or base_rows
        if len(none_rows) == 1 and len(base_rows) == 1:
            row.gap_recovered = gap_recovered(acc(row), acc(none_rows[0]), acc(base_rows[0]))


# ----------------------------------------------------------------------------------------- writing


def format_stat(stat: Stat, fmt: str) -> str:
    """``"0.450 ± 0.071"``, ``"0.450"`` for one run, ``"-"`` when no run logged it."""
    if stat.n == 0:
        return "-"
    text = fmt.format(stat.mean)
    if stat.n > 1:
        text += " ± " + fmt.replace("+", "").format(stat.std)  # a sign flag is for the mean only
    return text


def markdown_table(rows: list[Row]) -> str:
    """The table: group keys, n seeds, COLUMNS, and "gap recovered" when any row has one."""
    if not rows:
        raise ValueError("rows is empty: nothing to tabulate")
    group_keys = list(rows[0].group)
    with_gap = any(r.gap_recovered is not None for r in rows)
    header = (
        group_keys
        + ["n seeds"]
        + [title for _, title, _ in COLUMNS]
        + (["gap recovered"] if with_gap else [])
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for row in rows:
        cells = [row.group[k] for k in group_keys] + [str(len(row.run_ids))]
        cells += [format_stat(row.stats[col], fmt) for col, _, fmt in COLUMNS]
        if with_gap:
            cells.append("-" if row.gap_recovered is None else f"{row.gap_recovered:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _definitions() -> str:
    doc = __doc__ or ""
    start = doc.index("Definitions used")
    return doc[start:].strip()


def write_markdown(
    rows: list[Row],
    path: str | Path,
    title: str,
    excluded: list[RunRecord] | None = None,
    group_by: list[str] | None = None,
    plots: dict[str, Path] | None = None,
    skipped_plots: dict[str, str] | None = None,
    notes: list[str] | None = None,
) -> Path:
    """The report as markdown: table, excluded (non-FINISHED) runs, plots, notes, definitions."""
    path = Path(path)
    keys = group_by or list(rows[0].group)
    parts = [f"# {title}", "", markdown_table(rows), ""]
    if excluded:
        parts += ["## Excluded runs (not FINISHED, not averaged)", ""]
        parts += ["| run | run id | status | " + " | ".join(keys) + " | seed |"]
        parts += ["|" + "|".join(["---"] * (len(keys) + 4)) + "|"]
        for r in excluded:
            cells = [r.run_name or "-", r.run_id, r.status] + [r.params.get(k, "-") for k in keys]
            cells.append(r.params.get(SEED_PARAM, "?"))
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")
    if plots or skipped_plots:
        parts += ["## Plots", ""]
        for name, png in (plots or {}).items():
            parts.append(f"![{name}]({png.name})")
        for name, why in (skipped_plots or {}).items():
            parts.append(f"- {name}: skipped ({why})")
        parts.append("")
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    parts += ["## Definitions", "", _definitions(), ""]
    path.write_text("\n".join(parts))
    return path


LINE_STYLES = ("-", "--", ":", "-.")


def _line_styles(rows: list[Row]) -> dict[int, tuple[Any, str]]:
    """``id(row) -> (color, linestyle)``, distinct for up to 10 x 4 rows: with two or more group
    keys the last key picks the color and the first the line style (e.g. corrector -> color,
    precision -> style); with one key, the colors cycle and the style changes every 10 rows."""
    import matplotlib

    palette = matplotlib.colormaps["tab10"].colors
    keys = list(rows[0].group) if rows else []
    out: dict[int, tuple[Any, str]] = {}
    if len(keys) >= 2:
        colors = sorted({r.group[keys[-1]] for r in rows})
        styles = sorted({r.group[keys[0]] for r in rows})
        for r in rows:
            c, st = colors.index(r.group[keys[-1]]), styles.index(r.group[keys[0]])
            out[id(r)] = (palette[c % len(palette)], LINE_STYLES[st % len(LINE_STYLES)])
    else:
        for i, r in enumerate(rows):
            out[id(r)] = (palette[i % len(palette)], LINE_STYLES[(i // len(palette)) % len(LINE_STYLES)])
    return out


def plot_metric(
    rows: list[Row], metric: str, path: str | Path, ylabel: str | None = None, log_y: bool = False
) -> Path | None:
    """One line per row of ``row.histories[metric]`` vs step, a ± std band where > 1 run.

    ``metric`` is a MetricNames field name or an extra metric key. ``log_y`` uses a log y-axis when every plotted mean is
    > 0. Returns None (and writes nothing) when no row has the metric.
    """
    with_data = [r for r in rows if metric in r.histories]
    if not with_data:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    styles = _line_styles(with_data)
    for row in with_data:
        h = row.histories[metric]
        label = (", ".join(row.group.values()) or "all runs") + f" (n={len(row.run_ids)})"
        color, linestyle = styles[id(row)]
        (line,) = ax.plot(
            h["step"],
            h["mean"],
            label=label,
            color=color,
            linestyle=linestyle,
            marker="." if len(h["step"]) < 30 else None,
        )
        lo = [m - s if n > 1 else m for m, s, n in zip(h["mean"], h["std"], h["n"])]
        hi = [m + s if n > 1 else m for m, s, n in zip(h["mean"], h["std"], h["n"])]
        if any(n > 1 for n in h["n"]):
            ax.fill_between(h["step"], lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    if log_y and all(m > 0 for r in with_data for m in r.histories[metric]["mean"]):
        ax.set_yscale("log", nonpositive="clip")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel or metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def report_dict(
    rows: list[Row], excluded: list[RunRecord], meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The aggregated numbers as plain JSON-able data (non-finite numbers become null)."""
    return _json_safe(
        {
            **(meta or {}),
            "rows": [
                {
                    "group": r.group,
                    "n_runs": len(r.run_ids),
                    "run_ids": r.run_ids,
                    "seeds": r.seeds,
                    **{col: dataclasses.asdict(r.stats[col]) for col, _, _ in COLUMNS},
                    "gap_recovered": r.gap_recovered,
                    "histories": r.histories,
                }
                for r in rows
            ],
            "excluded_runs": [
                {"run_id": r.run_id, "run_name": r.run_name, "status": r.status, "params": r.params}
                for r in excluded
            ],
        }
    )


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


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
    experiment: str,
    out_dir: str | Path,
    group_by: list[str] | None = None,
    metric_names: MetricNames | None = None,
    extra_plots: list[str] | None = None,
) -> Report:
    """Load, aggregate and write ``report.md``, ``report.json`` and ``<metric>.png`` into ``out_dir``.

    ``extra_plots``: further metric keys (e.g. ``ais/severity``) plotted vs step like the
    PLOTTED ones, one PNG each named after the key.
    """
    names = metric_names or MetricNames()
    extra = list(dict.fromkeys(extra_plots or []))
    runs = load_runs(tracking_uri, experiment, names, extra_keys=extra)
    finished, excluded = split_finished(runs, experiment)
    keys = resolve_group_by(finished, group_by)
    missing = [k for k in keys if not any(k in r.params for r in finished)]
    if missing:
        raise ReportError(f"group-by param(s) {missing} not logged by any finished run of {experiment!r}")
    rows = aggregate(finished, keys, names, extra_keys=extra)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

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
        precision_key, corrector_key = DEFAULT_GROUP_BY
        if precision_key in keys and corrector_key in keys:
            why = "it needs fp32 and 'none' rows at the same other group values, and a nonzero gap"
        else:
            why = f"it needs {precision_key!r} and {corrector_key!r} among the group keys"
        notes.append(f"no 'gap recovered' column: {why}")

    md = write_markdown(
        rows,
        out / "report.md",
        title=f"Sweep report: {experiment}",
        excluded=excluded,
        group_by=keys,
        plots=plots,
        skipped_plots=skipped,
        notes=notes,
    )
    meta = {
        "experiment": experiment,
        "tracking_uri": tracking_uri,
        "group_by": keys,
        "metric_names": dataclasses.asdict(names),
        "plots": {k: p.name for k, p in plots.items()},
        "skipped_plots": skipped,
        "notes": notes,
    }
    js = out / "report.json"
    js.write_text(json.dumps(report_dict(rows, excluded, meta), indent=1))
    return Report(markdown=md, json=js, plots=plots, skipped_plots=skipped, rows=rows, excluded=excluded)
