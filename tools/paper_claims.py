"""Check the AIS paper's claims on a sweep report: the numbers behind docs/results.md.

Reads the ``report.json`` that ``tools/sweep_report.py`` wrote for a precision x corrector x seed
sweep with an fp32 baseline (rows grouped by the ``rollout`` and ``corrector`` options, or by the
``rollout.precision`` / ``corrector.name`` params of older stores) and
prints a markdown section, one claim per heading, each with the measured numbers:

1. uncorrected low precision loses part of the fp32 gain (val acc gain, none vs fp32);
2. correctors recover the gap: (gain - gain_none) / (gain_fp32 - gain_none) per corrector;
3. AIS vs the best of none / TIS / MIS at the same precision (where there is no gap, none may be best);
4. mismatch KL, entropy and the AIS lambda (``--lambda-key``) over the first vs the last quarter
   of training, and the correlation of lambda with entropy;
5. rollout throughput of each precision relative to fp32 inside training;
6. "exploration early, bias later": each row's greedy val accuracy minus the uncorrected run's at
   the same precision, early (the validation nearest to a quarter of training) and late (the end),
   and its sampled training reward over the first and the last quarter of the steps.

The full-precision baseline is the report's ``baseline`` (``sweep_report.py --baseline``, default
fp32; ``llada_fp32`` for the diffusion family).

Every ± is the half-width of a 95% Student's t-interval (``ais_lightning.toolkit.report.intervals``, scipy.stats),
with the seed count beside it: a row's mean over its n seeds (t with n - 1 degrees of freedom); a difference of two
rows, Welch's interval over their seeds; and, where both rows ran the same seeds (``report.json`` keeps every run's
value), paired by seed: the interval of the mean of the per-seed differences (t with pairs - 1 degrees of freedom).
A seed fixes the validation prompts and the starting accuracy, so pairing removes what the seeds share, which
dominates when the validation sets differ a lot. At 3 to 5 seeds the t quantile is 4.30 to 2.78, not 2.

``--lambda-plot PATH.png`` also draws, for the rows whose corrector is ``--lambda-corrector`` (default
ais), the lambda trajectory against entropy and mismatch KL in one figure: (a) lambda, (b) entropy and
(c) mismatch KL (log) vs step, one line per precision, ± std over seeds; (d) lambda vs mismatch KL at
every step, coloured by entropy: lambda near 0 where the mismatch is harmless, near 1 where it is
ruinous. Rows without a ``--lambda-key`` history are skipped (named on stderr). Usage:

    python tools/sweep_report.py ... --plot mismatch/ais_lambda --out docs/results/engine
    python tools/paper_claims.py docs/results/engine/report.json [--lambda-key mismatch/ais_lambda]
        [--lambda-plot docs/results/engine/lambda_regimes.png [--lambda-corrector ais]]

(``--lambda-key ais_lambda`` reads the AIS corrector's applied ``ais/lambda``, which the report keeps
whenever it was logged.) Exit status 2 on a missing baseline row, or when ``--lambda-plot`` finds no
row to draw.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from ais_lightning.toolkit.report import (
    gap_recovered,
    mean_half_width,
    paired_interval,
    reference_keys,
    welch_interval,
)


def _stat(row: dict, col: str) -> tuple[float, float, int]:
    """(mean, std, n) of ``row[col]`` (a ``{"mean", "std", "n"}`` dict); nan / 0 where missing."""
    s = row.get(col) or {}
    mean = s.get("mean")
    std = s.get("std")
    return (
        float("nan") if mean is None else mean,
        float("nan") if std is None else std,
        s.get("n") or 0,
    )


def paired_diff(a: dict, b: dict, col: str) -> tuple[float, float, int]:
    """Rows ``a`` - ``b`` paired by seed: (mean of the per-seed differences, the half-width of its 95% t-interval,
    pairs).

    Reads ``row["seeds"]`` and ``row[col]["values"]`` (in run order); seeds both rows have with finite
    values are paired. (nan, nan, pairs) with fewer than 2 pairs, or when a row keeps no values."""

    va, vb = _by_seed(a, col), _by_seed(b, col)
    return paired_interval([va[seed] - vb[seed] for seed in va if seed in vb])


def _mean(stat: tuple[float, float, int]) -> str:
    """A row's ``mean ± half-width (n)`` (the 95% t-interval of the mean over its n seeds)."""
    mean, std, n = stat
    return f"{_fmt(mean)} ± {_fmt(mean_half_width(std, n), '.3f')} ({n})"


def _diff(a: tuple[float, float, int], b: tuple[float, float, int]) -> str:
    """``mean_a - mean_b ± half-width`` of Welch's 95% t-interval."""
    d, half = welch_interval(a, b)
    return f"{_fmt(d)} ± {_fmt(half, '.3f')}"


def _by_seed(row: dict, col: str) -> dict[str, float]:
    """``{seed: value}`` of ``row[col]["values"]`` (finite values only)."""
    values = (row.get(col) or {}).get("values") or []
    return {seed: v for seed, v in zip(row.get("seeds", []), values) if v is not None and math.isfinite(v)}


def _share(x: float, none: float, base: float) -> float:
    """``ais_lightning.toolkit.report.gap_recovered`` with nan for "no gap to recover" (this tool's tables print nan)."""
    share = gap_recovered(x, none, base)
    return float("nan") if share is None else share


def recovered_share(x: dict, none: dict, base: dict, col: str) -> float:
    """(x - none) / (base - none) over the seeds all three rows share (a seed fixes the validation prompts).

    Equals the ratio of the row means when the rows hold the same seeds; when they do not (a row with
    extra seeds, pooled from a second sweep), comparing means over different seeds would mix validation
    sets, so the shared seeds are used. nan when no seed is shared or the gap over them is 0."""
    vx, vn, vb = _by_seed(x, col), _by_seed(none, col), _by_seed(base, col)
    shared = [seed for seed in vx if seed in vn and seed in vb]
    if not shared:
        return float("nan")
    return _share(*(statistics.fmean(v[s] for s in shared) for v in (vx, vn, vb)))


def _paired(d: tuple[float, float, int]) -> str:
    return "n/a" if not math.isfinite(d[0]) else f"{_fmt(d[0])} ± {_fmt(d[1], '.3f')} ({d[2]})"


def quarter_means(history: dict) -> tuple[float, float]:
    """Mean of the history's mean curve over the first and the last quarter of its steps."""
    values = [v for v in history.get("mean", []) if v is not None and math.isfinite(v)]
    if len(values) < 4:
        return float("nan"), float("nan")
    q = len(values) // 4
    return statistics.fmean(values[:q]), statistics.fmean(values[-q:])


VARIANCE_AMPLIFICATION_KEY = "ais/variance_amplification"
"""History of AIS v2's V = 1 + chi2_A (``sweep_report.py --plot ais/variance_amplification``)."""


def correction_size(lam: dict, amplification: dict) -> dict:
    """Per step, lambda * sqrt(V - 1) from the seed-mean curves of lambda and V = 1 + chi2_A: about the
    root mean square of (weight - 1) that AIS applies (``(1 - lambda) + lambda b``, chi2_A = E(b - 1)^2
    weighted by A^2), i.e. how much the corrector changes the update, as a history dict."""
    a = dict(zip(lam.get("step", []), lam.get("mean", [])))
    b = dict(zip(amplification.get("step", []), amplification.get("mean", [])))
    steps = [s for s in a if s in b and a[s] is not None and b[s] is not None]
    return {"step": steps, "mean": [a[s] * math.sqrt(max(b[s] - 1.0, 0.0)) for s in steps]}


def correlation(h1: dict, h2: dict) -> float:
    """Pearson correlation of two mean curves over their common steps (nan if undefined)."""
    a = dict(zip(h1.get("step", []), h1.get("mean", [])))
    b = dict(zip(h2.get("step", []), h2.get("mean", [])))
    steps = [s for s in a if s in b and a[s] is not None and b[s] is not None]
    if len(steps) < 3:
        return float("nan")
    x, y = [a[s] for s in steps], [b[s] for s in steps]
    try:
        return statistics.correlation(x, y)
    except statistics.StatisticsError:  # a constant curve
        return float("nan")


def _fmt(x: float, spec: str = "+.3f") -> str:
    return "n/a" if not math.isfinite(x) else format(x, spec)


def history_at(history: dict, step: float) -> tuple[float, float, int]:
    """(mean, std, n) of the history's first point at or after ``step`` (nan, nan, 0 if none)."""
    for i, s in enumerate(history.get("step", [])):
        if s >= step:
            point = {key: (history.get(key) or [None] * (i + 1))[i] for key in ("mean", "std", "n")}
            return _stat({"point": point}, "point")
    return _stat({}, "point")


def corrector_label(group: dict, precision: str, corrector: str) -> str:
    """The row's corrector option, followed by ``key=value`` for each other group key the row sets (a report
    grouped by more than precision and corrector, e.g. ``--group-by rollout,corrector,corrector.spread``
    over runs of two forms of one corrector); rows that leave such a key unset keep the plain name."""
    extra = [
        f"{k}={v}"
        for k, v in group.items()
        if k not in (precision, corrector, "algorithm") and v not in (None, "", "-")
    ]
    name = str(group.get(corrector))
    return f"{name} ({', '.join(extra)})" if extra else name


def is_ais(label: str) -> bool:
    """Whether a row label names AIS v2 (``ais``, or ``ais (key=value...)``), not ``ais_v1`` and the like."""
    return label == "ais" or label.startswith("ais (")


def claims_markdown(report: dict, lambda_key: str, metric: str = "val_accuracy_gain") -> str:
    precision, corrector = reference_keys(list(report["rows"][0]["group"]) if report["rows"] else [])
    baseline = (report.get("baseline") or {}).get("precision", "fp32")
    # the paper's claims are about GRPO with a corrector: other algorithms (Sol-RL) in the store are left out
    grpo = [r for r in report["rows"] if r["group"].get("algorithm", "grpo") == "grpo"]
    rows = {(r["group"].get(precision), corrector_label(r["group"], precision, corrector)): r for r in grpo}
    base = rows.get((baseline, "none"))
    if base is None:
        raise ValueError(f"report has no {baseline} / none row (the full-precision baseline)")
    precisions = sorted({p for p, _ in rows if p != baseline})
    label = {"val_accuracy_gain": "val acc gain", "final_val_accuracy": "final val acc"}.get(metric, metric)
    out = [
        f"Metric: {label}. Every ± is the half-width of a 95% t-interval: a row's mean over its seeds (count in "
        "brackets), a difference of two rows (Welch), a difference paired by seed (pairs in brackets).",
        "",
    ]

    out += [f"### 1. Uncorrected low precision vs {baseline}", ""]
    out += [
        f"| precision | {label} (none) | {baseline} | none - {baseline} | paired by seed (pairs) "
        f"| lost share of the {baseline} gain |",
        "|---|---|---|---|---|---|",
    ]
    base_stat = _stat(base, metric)
    for p in precisions:
        if (p, "none") not in rows:
            continue
        none = _stat(rows[(p, "none")], metric)
        d = none[0] - base_stat[0]
        lost = -d / base_stat[0] + 0.0 if metric == "val_accuracy_gain" and base_stat[0] else float("nan")
        out.append(
            f"| {p} | {_mean(none)} | {_mean(base_stat)} | {_diff(none, base_stat)} "
            f"| {_paired(paired_diff(rows[(p, 'none')], base, metric))} | {_fmt(lost, '.0%')} |"
        )

    out += ["", f"### 2. Gap recovered by each corrector: (x - none) / ({baseline} - none)", ""]
    out += [
        "One row per corrector, best first. A gap whose 95% t-interval (Welch) contains 0 is marked: its ratios "
        "are noise, not recovery. Gap recovered is taken over the seeds the row shares with none and the "
        "baseline (the plain ratio of means when every row holds the same seeds).",
        "",
        f"| precision | corrector | {label} | seeds | x - none | paired by seed (pairs) | gap recovered |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in precisions:
        if (p, "none") not in rows:
            continue
        none_stat = _stat(rows[(p, "none")], metric)
        gap, gap_half = welch_interval(base_stat, none_stat)
        noise = " (0 in the gap's 95% interval)" if math.isfinite(gap_half) and abs(gap) <= gap_half else ""
        here = [(c, _stat(row, metric)) for (pp, c), row in rows.items() if pp == p and c != "none"]
        for c, x in sorted(here, key=lambda t: (-t[1][0] if math.isfinite(t[1][0]) else math.inf, t[0])):
            paired = _paired(paired_diff(rows[(p, c)], rows[(p, "none")], metric))
            recovered = recovered_share(rows[(p, c)], rows[(p, "none")], base, metric)
            if not math.isfinite(recovered):  # rows without per-seed values: the ratio of the means
                recovered = _share(x[0], none_stat[0], base_stat[0])
            out.append(
                f"| {p} (gap {_fmt(gap)} ± {_fmt(gap_half, '.3f')}{noise}) | {c} | {_mean(x)} | {x[2]} "
                f"| {_diff(x, none_stat)} | {paired} | {_fmt(recovered, '.2f')} |"
            )

    out += ["", "### 3. AIS vs the best of none / TIS / MIS", ""]
    out += [
        "| precision | AIS | best of none/TIS/MIS | AIS - best | paired by seed (pairs) |",
        "|---|---|---|---|---|",
    ]
    for (p, c), row in sorted(rows.items()):
        if p == baseline or not is_ais(c):
            continue
        ais = _stat(row, metric)
        others = [(o, _stat(rows[(p, o)], metric)) for o in ("none", "tis", "mis") if (p, o) in rows]
        if not others:
            continue
        best_name, best = max(others, key=lambda t: t[1][0])
        paired = _paired(paired_diff(row, rows[(p, best_name)], metric))
        name = p if c == "ais" else f"{p}, {c}"
        out.append(
            f"| {name} | {_fmt(ais[0])} | {best_name} {_fmt(best[0])} | {_diff(ais, best)} | {paired} |"
        )

    out += ["", "### 4. Over training: first vs last quarter of the steps", ""]
    out += [
        "lambda * sqrt(chi2_A) (from the AIS rows' `ais/variance_amplification` history, when reported) is about "
        "the root mean square of (weight - 1): how much the corrector changes the update.",
        "",
        "| precision, corrector | mismatch KL | entropy | lambda | lambda * sqrt(chi2_A) | corr(lambda, entropy) |",
        "|---|---|---|---|---|---|",
    ]
    for (p, c), row in sorted(rows.items()):
        if p == baseline:
            continue
        h = row.get("histories", {})
        kl = quarter_means(h.get("mismatch_kl", {}))
        ent = quarter_means(h.get("entropy", {}))
        lam = quarter_means(h.get(lambda_key, {}))
        size = quarter_means(correction_size(h.get(lambda_key, {}), h.get(VARIANCE_AMPLIFICATION_KEY, {})))
        r = correlation(h.get(lambda_key, {}), h.get("entropy", {}))
        out.append(
            f"| {p}, {c} | {_fmt(kl[0], '.2e')} -> {_fmt(kl[1], '.2e')} | {_fmt(ent[0], '.3f')} -> "
            f"{_fmt(ent[1], '.3f')} | {_fmt(lam[0], '.4f')} -> {_fmt(lam[1], '.4f')} | "
            f"{_fmt(size[0], '.4f')} -> {_fmt(size[1], '.4f')} | {_fmt(r, '+.2f')} |"
        )

    out += ["", f"### 5. Rollout throughput inside training, relative to {baseline}", ""]
    out += ["| precision | rollout tok/s (mean over its runs) | vs baseline |", "|---|---|---|"]
    tps_base = _stat(base, "rollout_tokens_per_s")[0]
    for p in [baseline, *precisions]:
        vals = [_stat(r, "rollout_tokens_per_s") for (pp, _), r in rows.items() if pp == p]
        vals = [v[0] for v in vals if math.isfinite(v[0])]
        if vals:
            tps = statistics.fmean(vals)
            out.append(f"| {p} | {tps:.0f} | {tps / tps_base:.2f}x |")

    out += early_vs_late(rows, baseline)
    return "\n".join(out) + "\n"


def early_vs_late(rows: dict, baseline: str) -> list[str]:
    """Claim 6, "exploration early, bias later": greedy val accuracy of each row minus that of the
    uncorrected row at the same precision, at the validation nearest to a quarter of the training
    steps ("early"; never the one before training) and at the last validation ("late"); the baseline row is compared with
    each precision's uncorrected row the same way. An early advantage of ``none`` shows as negative
    differences early; late damage as positive ones late. The sampled training reward is compared the
    same way over the first and the last quarter of the steps (means of the seed-mean curves: the
    reward the rollouts themselves earned, where exploration would show first)."""
    out = ["", "### 6. Exploration early, bias later: val accuracy minus the uncorrected run's", ""]
    out += [
        "Early = the validation nearest to 1/4 of the steps, late = the last one (differences ± the half-width of "
        "Welch's 95% t-interval); "
        "reward = the sampled training reward over the first / last quarter of the steps.",
        "",
        "| precision | row | early step | early: x - none | late step | late: x - none "
        "| reward, first quarter: x - none | reward, last quarter: x - none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted({p for p, _ in rows if p != baseline}):
        if (p, "none") not in rows:
            continue
        none_h = rows[(p, "none")].get("histories", {}).get("val_accuracy", {})
        none_reward = quarter_means(rows[(p, "none")].get("histories", {}).get("reward", {}))
        steps = none_h.get("step", [])
        if len(steps) < 2:
            continue
        late = steps[-1]
        early = min(steps[1:], key=lambda s: abs(s - late / 4))  # the first tie wins
        others = [(baseline, rows[(baseline, "none")])] + sorted(
            (c, row) for (pp, c), row in rows.items() if pp == p and c != "none"
        )
        for name, row in others:
            h = row.get("histories", {}).get("val_accuracy", {})
            cells = [_diff(history_at(h, step), history_at(none_h, step)) for step in (early, late)]
            reward = quarter_means(row.get("histories", {}).get("reward", {}))
            cells += [_fmt(x - x_none) for x, x_none in zip(reward, none_reward)]
            out.append(
                f"| {p} | {name} | {early:g} | {cells[0]} | {late:g} | {cells[1]} | {cells[2]} | {cells[3]} |"
            )
    return out


LAMBDA_FIGSIZE = (14.0, 8.0)
"""Size of the ``--lambda-plot`` figure in inches (saved at LAMBDA_DPI: 1400 x 800 pixels)."""
LAMBDA_DPI = 100
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _curve(history: dict, positive: bool = False) -> dict[str, list[float]]:
    """The points of a history with a finite mean (and > 0 when ``positive``, for a log axis): step,
    mean, and the ± std band ``lo`` / ``hi`` (the mean itself where the std is missing or from one run)."""
    steps = list(history.get("step") or [])
    means = list(history.get("mean") or []) + [None] * len(steps)
    stds = list(history.get("std") or []) + [None] * len(steps)
    ns = list(history.get("n") or []) + [None] * len(steps)  # no counts: trust a finite std
    out: dict[str, list[float]] = {"step": [], "mean": [], "lo": [], "hi": []}
    for step, m, s, n in zip(steps, means, stds, ns):
        if not _finite(m) or (positive and m <= 0):
            continue
        band = s if _finite(s) and (n is None or n > 1) else 0.0
        out["step"].append(step)
        out["mean"].append(m)
        out["lo"].append(m - band)
        out["hi"].append(m + band)
    return out


def lambda_rows(report: dict, lambda_key: str, corrector: str) -> list[tuple[str, dict]]:
    """(precision, row) of the GRPO rows labelled ``corrector`` (``corrector_label``) that have a finite
    ``lambda_key`` history, sorted by precision. The other rows of that corrector are named on stderr;
    ValueError (naming ``--lambda-corrector`` and ``--lambda-key``) when no row qualifies."""
    rows = report.get("rows") or []
    precision, corrector_key = reference_keys(list(rows[0]["group"]) if rows else [])
    grpo = [r for r in rows if r["group"].get("algorithm", "grpo") == "grpo"]
    picked = [r for r in grpo if corrector_label(r["group"], precision, corrector_key) == corrector]
    out = []
    for row in picked:
        name = row["group"].get(precision, "?")
        if _curve(row.get("histories", {}).get(lambda_key, {}))["step"]:
            out.append((name, row))
        else:
            print(
                f"paper_claims: --lambda-plot skips {name}, {corrector}: no {lambda_key!r} history",
                file=sys.stderr,
            )
    if not out:
        correctors = sorted({corrector_label(r["group"], precision, corrector_key) for r in grpo})
        keys = sorted({k for r in picked for k in r.get("histories", {})})
        raise ValueError(
            f"--lambda-plot: no GRPO row with corrector {corrector!r} (--lambda-corrector) has a "
            f"{lambda_key!r} history (--lambda-key); correctors in the report: {correctors}"
            + (f", histories of the {corrector!r} rows: {keys}" if picked else "")
        )
    return sorted(out, key=lambda t: t[0])


def plot_lambda_regimes(report: dict, lambda_key: str, corrector: str, path: str | Path) -> Path:
    """One PNG: the AIS lambda of every ``corrector`` row (see :func:`lambda_rows`) against entropy and
    mismatch KL. (a) lambda, (b) entropy and (c) mismatch KL (log y) vs step, one line per precision in
    the same colour in every panel, ± std band where the row averages several runs; (d) lambda vs
    mismatch KL (log x) at every step of every row, coloured by the step's entropy (grey without one),
    one marker per precision. Steps whose KL is not finite and > 0 are left out of (c) and (d)."""
    rows = lambda_rows(report, lambda_key, corrector)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    palette = matplotlib.colormaps["tab10"].colors  # the colours of ais_lightning.toolkit.report.render
    fig = plt.figure(figsize=LAMBDA_FIGSIZE, layout="constrained")
    grid = fig.add_gridspec(3, 2, width_ratios=(1.15, 1.0))
    ax_lam = fig.add_subplot(grid[0, 0], label="lambda")
    ax_ent = fig.add_subplot(grid[1, 0], sharex=ax_lam, label="entropy")
    ax_kl = fig.add_subplot(grid[2, 0], sharex=ax_lam, label="mismatch_kl")
    ax_sc = fig.add_subplot(grid[:, 1], label="scatter")

    points = []  # (precision index, kl, lambda, entropy) of every step with lambda and KL > 0
    for i, (name, row) in enumerate(rows):
        h = row.get("histories", {})
        color = palette[i % len(palette)]
        label = f"{name} (n={row['n_runs']})" if "n_runs" in row else name
        for ax, key, positive in (
            (ax_lam, lambda_key, False),
            (ax_ent, "entropy", False),
            (ax_kl, "mismatch_kl", True),
        ):
            c = _curve(h.get(key, {}), positive=positive)
            if not c["step"]:
                continue
            marker = "." if len(c["step"]) < 30 else None
            ax.plot(c["step"], c["mean"], color=color, marker=marker, label=label)
            if c["lo"] != c["hi"]:
                ax.fill_between(c["step"], c["lo"], c["hi"], color=color, alpha=0.2, linewidth=0)
        lam = dict(zip(*(_curve(h[lambda_key])[k] for k in ("step", "mean"))))
        kl = dict(zip(*(_curve(h.get("mismatch_kl", {}), positive=True)[k] for k in ("step", "mean"))))
        ent = dict(zip(*(_curve(h.get("entropy", {}))[k] for k in ("step", "mean"))))
        points += [(i, kl[s], lam[s], ent.get(s, math.nan)) for s in lam if s in kl]

    entropies = [p[3] for p in points if math.isfinite(p[3])]
    norm = Normalize(min(entropies), max(entropies)) if entropies else Normalize(0.0, 1.0)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    for i, (name, _) in enumerate(rows):
        mine = [p for p in points if p[0] == i]
        if mine:
            ax_sc.scatter(
                [p[1] for p in mine],
                [p[2] for p in mine],
                c=[p[3] for p in mine],
                cmap=cmap,
                norm=norm,
                marker=_MARKERS[i % len(_MARKERS)],
                edgecolors=[palette[i % len(palette)]],
                linewidths=1.0,
                s=36,
                plotnonfinite=True,  # a step without entropy is drawn in grey, not dropped
                label=name,
            )
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax_sc, label="entropy (nats)")

    ax_lam.set_title(f"(a) AIS lambda ({lambda_key}): 0 = no correction, 1 = full", fontsize="medium")
    ax_ent.set_title("(b) entropy", fontsize="medium")
    ax_kl.set_title("(c) mismatch KL", fontsize="medium")
    ax_sc.set_title(
        "(d) lambda vs mismatch KL at every step, colour = entropy, edge = precision", fontsize="medium"
    )
    for ax in (ax_lam, ax_sc):
        ax.set_ylim(-0.03, 1.03)
    ax_lam.set_ylabel("lambda")
    ax_ent.set_ylabel("entropy (nats)")
    ax_kl.set_ylabel("mismatch KL")
    ax_kl.set_xlabel("step")
    if ax_kl.lines:
        ax_kl.set_yscale("log", nonpositive="clip")
    if points:
        ax_sc.set_xscale("log", nonpositive="clip")
    ax_sc.set_xlabel("mismatch KL (log)")
    ax_sc.set_ylabel("lambda")
    for ax in (ax_lam, ax_ent):
        ax.tick_params(labelbottom=False)
    for ax in (ax_lam, ax_ent, ax_kl, ax_sc):
        ax.grid(alpha=0.3)
    ax_lam.legend(fontsize="small", title="precision", loc="best")
    if points:
        legend = ax_sc.legend(fontsize="small", title="precision", loc="best")
        for handle in legend.legend_handles:
            handle.set_facecolor("none")  # the marker and its edge name the precision, not an entropy
    fig.suptitle(
        f"{report.get('experiment', 'sweep')}: AIS lambda ({corrector} rows) vs entropy and mismatch KL"
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=LAMBDA_DPI)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("report", help="report.json written by tools/sweep_report.py")
    parser.add_argument(
        "--lambda-key",
        default="mismatch/ais_lambda",
        help="history holding lambda (pass it to sweep_report.py --plot; ais_lambda is the AIS "
        "corrector's applied ais/lambda; default %(default)s)",
    )
    parser.add_argument(
        "--metric",
        default="val_accuracy_gain",
        help="report column compared in claims 1-3 (default %(default)s)",
    )
    parser.add_argument(
        "--lambda-plot",
        metavar="PATH.png",
        default=None,
        help="also draw the lambda of the --lambda-corrector rows vs step next to entropy and mismatch KL, "
        "and lambda vs mismatch KL coloured by entropy, into this PNG",
    )
    parser.add_argument(
        "--lambda-corrector",
        default="ais",
        help="corrector whose rows --lambda-plot draws, one line per precision (default %(default)s); a row "
        "of a report grouped by a third key is named with it, e.g. 'ais (corrector.spread=impurity)'",
    )
    args = parser.parse_args(argv)
    try:
        report = json.loads(Path(args.report).read_text())
        print(claims_markdown(report, args.lambda_key, args.metric))
        if args.lambda_plot:
            path = plot_lambda_regimes(report, args.lambda_key, args.lambda_corrector, args.lambda_plot)
            print(f"wrote {path}", file=sys.stderr)  # stdout is the claims markdown only
    except (OSError, ValueError, KeyError) as err:
        print(f"paper_claims: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
