"""Statistics: runs grouped into configurations, per-run numbers, means with t-intervals, gap recovered, mean
histories.

Definitions used in the table (per run first, then over the runs of a configuration the mean ± the half-width of
its 95% t-interval, t(n - 1) * s / sqrt(n) with s the sample std (ddof=1) and n the runs, the "n seeds" column, or
the count in brackets when fewer runs logged the metric (Student's t: ``scipy.stats.t``,
:mod:`ais_lightning.toolkit.report.intervals`); the interval is omitted when a configuration has a single run;
report.json also keeps the std; metric keys are the defaults, see ``metric_names`` in report.json for the ones
actually read):

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

import math
import statistics
from dataclasses import dataclass, field

from ais_lightning.toolkit.report.intervals import mean_half_width
from ais_lightning.toolkit.report.records import MetricNames, RunRecord

DEFAULT_GROUP_BY = ("rollout", "corrector")
"""Group keys used when present in the runs' params: the rollout and corrector options picked, as
``ais-train`` logs them (``rollout=fp4``, ``corrector=ais``). Else LEGACY_GROUP_BY, else every param
that varies, except ``seed``."""
VARYING_GROUP_BY = ("algorithm",)
"""Options grouped by (before the DEFAULT_GROUP_BY keys) only when they differ across the runs, e.g.
``algorithm=solrl`` runs in a sweep of ``algorithm=grpo`` ones."""
LEGACY_GROUP_BY = ("rollout.precision", "corrector.name")
"""The group keys of stores written before the option choices were logged."""

SEED_PARAM = "seed"
PER_RUN_PARAMS = (SEED_PARAM, "output_dir", "ckpt_path", "logger.run_name")
"""Params that differ between runs of one configuration by construction; never grouped on."""

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
class Stat:
    """Mean, sample standard deviation and t-interval of one quantity over the runs of a configuration."""

    mean: float
    """Mean over the runs that have the quantity (nan if none has it)."""
    std: float
    """Sample std (ddof=1); nan with fewer than 2 values."""
    n: int
    """Number of runs that contributed."""
    values: list[float] = field(default_factory=list)
    """Every run's value, in the row's run order (``Row.seeds``; nan where a run lacks it): what a
    comparison paired by seed reads."""

    @property
    def half_width(self) -> float:
        """Half-width of the 95% t-interval of the mean, t(n - 1) * std / sqrt(n); nan with fewer than 2 values."""
        return mean_half_width(self.std, self.n)


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
    """Column name -> mean, std and t-interval over the runs (see COLUMNS)."""
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


def resolve_group_by(runs: list[RunRecord], group_by: list[str] | None = None) -> list[str]:
    """``group_by`` if given; else DEFAULT_GROUP_BY keys present in any run; else every varying
    param except ``seed``."""
    if group_by:
        return list(group_by)
    for keys in (DEFAULT_GROUP_BY, LEGACY_GROUP_BY):
        present = [k for k in keys if any(k in r.params for r in runs)]
        if present:
            return [k for k in VARYING_GROUP_BY if k in varying_params(runs)] + present
    return varying_params(runs, exclude=PER_RUN_PARAMS)


def reference_keys(group_by: list[str]) -> tuple[str, str]:
    """The (precision, corrector) keys of the gap-recovered column among ``group_by``: the option names
    (``rollout``, ``corrector``) when grouped by them, else the legacy params."""
    precision = DEFAULT_GROUP_BY[0] if DEFAULT_GROUP_BY[0] in group_by else LEGACY_GROUP_BY[0]
    corrector = DEFAULT_GROUP_BY[1] if DEFAULT_GROUP_BY[1] in group_by else LEGACY_GROUP_BY[1]
    return precision, corrector


def varying_params(runs: list[RunRecord], exclude: tuple[str, ...] = ()) -> list[str]:
    """Params whose value (or presence) differs across ``runs``, sorted, minus ``exclude``."""
    keys = sorted({k for r in runs for k in r.params} - set(exclude))
    return [k for k in keys if len({r.params.get(k) for r in runs}) > 1]


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _stat(values: list[float]) -> Stat:
    vals = _finite(values)
    if not vals:
        return Stat(float("nan"), float("nan"), 0, list(values))
    std = statistics.stdev(vals) if len(vals) > 1 else float("nan")
    return Stat(statistics.fmean(vals), std, len(vals), list(values))


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
    precision_key: str | None = None,
    corrector_key: str | None = None,
    baseline_precision: str = "fp32",
    no_correction: str = "none",
    extra_keys: tuple[str, ...] | list[str] = (),
) -> list[Row]:
    """One Row per distinct ``group_by`` value tuple of the (FINISHED) ``runs``, sorted by it
    (an empty ``group_by`` gives a single row). ``row.histories`` holds the PLOTTED metrics under
    their MetricNames field and every ``extra_keys`` metric under its own key.

    The gap-recovered value is filled when both ``precision_key`` and ``corrector_key`` (default:
    :func:`reference_keys`) are group keys (see the module docstring).
    """
    default_precision, default_corrector = reference_keys(group_by)
    precision_key = precision_key or default_precision
    corrector_key = corrector_key or default_corrector
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
