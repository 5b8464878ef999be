"""Tables of the asynchronous GRPO evidence (docs/async.md section 7) from an MLflow store: what staleness costs at
each precision, what each corrector recovers, paired by seed.

Per run: the final greedy validation accuracy at the trainer's precision (``val/accuracy_trainer``, last value) and at
the engine's (``val/accuracy_engine``), the mean reward of the last 50 steps, the mean KL k3 of the two sources
(``mismatch/precision/kl_k3``, ``mismatch/staleness/kl_k3``) and AIS's mean lambda. Runs are grouped by ``--group``
params (default: rollout, corrector, algorithm.max_staleness; plus algorithm.adaptive_staleness when it varies).

Tables (markdown on stdout, and ``--json``):

1. every cell's mean final accuracy over seeds ± the half-width of its 95% t-interval [seeds];
2. the cost of staleness: per precision and corrector, accuracy at staleness k minus at staleness 0, paired by seed;
3. what a corrector recovers: per precision and staleness, (corrector - none), paired by seed
   (``--corrector-baseline tis``: each corrector against TIS instead);
4. the two sources: mean KL of each part and lambda per cell;
5. for runs with Ray workers: seconds per step of the step, the trainer's wait for rollouts, the weights' put into
   the object store and a worker's load of them (``time/step_s``, ``async/idle_s``, ``async/publish_s``,
   ``async/worker_sync_s``);
6. ``--pair A B``: any two cells' paired difference (e.g. AIS with the adaptive bound against TIS with the fixed one);
7. with ``--curve``: the learning curve, each cell's mean reward over each quarter of its steps (``reward_q1`` ..
   ``reward_q4``; any of them is a ``--metric`` for the paired tables).

A difference is given as mean ± its standard error and the 95% t-interval's half-width (``t(n-1) s_d / sqrt(n)``);
"> 2 SE" marks a difference larger than two standard errors.

    python tools/async_report.py --tracking-uri http://127.0.0.1:5077 --experiment async_default --json a.json
    python tools/async_report.py --tracking-uri ... --experiment async_ray --experiment async_default --curve \
        --group workers,rollout,corrector,algorithm.max_staleness --baseline-param workers --baseline-value None
    python tools/async_report.py --tracking-uri ... --experiment async_varying --group rollout,corrector,\
algorithm.max_staleness,algorithm.adaptive_staleness --baseline-param algorithm.max_staleness --baseline-value 0
    python tools/async_report.py --tracking-uri ... --experiment async_varying --experiment async_varying_heldout \
        --unit experiment,seed ...    # two warm starts pooled: 5 + 3 seeds paired as 8 units
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from ais_lightning.toolkit.report.intervals import paired_interval

METRICS = {
    "acc_trainer": ("val/accuracy_trainer", "last"),
    "acc_engine": ("val/accuracy_engine", "last"),
    "reward_last50": ("reward/mean", "last50"),
    "kl_precision": ("mismatch/precision/kl_k3", "mean"),
    "kl_staleness": ("mismatch/staleness/kl_k3", "mean"),
    "kl_whole": ("mismatch/kl_k3", "mean"),
    "lambda": ("ais/lambda", "mean"),
    "staleness": ("staleness/mean", "mean"),
    "bound": ("staleness/bound", "mean"),
    "step_s": ("time/step_s", "mean"),
    "idle_s": ("async/idle_s", "mean"),
    "publish_s": ("async/publish_s", "mean"),
    "worker_sync_s": ("async/worker_sync_s", "mean"),
    **{f"reward_q{q}": ("reward/mean", f"quarter{q}") for q in range(1, 5)},
}
"""name -> (logged key, how: the last value, the mean of the last 50, of all, or of the q-th quarter of the steps)."""


def summarize(xs: list[float], how: str) -> float:
    """One run's value of a metric from its per-step values ``xs`` (step order) as ``how`` says."""
    if how == "last":
        return xs[-1]
    if how.startswith("quarter"):
        q, n = int(how[-1]), len(xs)
        return statistics.fmean(xs[(q - 1) * n // 4 : max(q * n // 4, (q - 1) * n // 4 + 1)])
    return statistics.fmean(xs[-50:] if how == "last50" else xs)


def load(uri: str, experiment: str) -> list[dict[str, Any]]:
    """Every FINISHED run of ``experiment``: its params and the per-run values of :data:`METRICS`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no experiment {experiment!r} at {uri}")
    runs = []
    for run in client.search_runs([exp.experiment_id], max_results=5000):
        if run.info.status != "FINISHED":
            continue
        values: dict[str, float] = {}
        for name, (key, how) in METRICS.items():
            history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
            xs = [m.value for m in history if math.isfinite(m.value)]
            if not xs:
                continue
            values[name] = summarize(xs, how)
        runs.append({"experiment": experiment, "params": dict(run.data.params), "values": values})
    return runs


def cells(
    runs: list[dict[str, Any]], group: list[str], unit: tuple[str, ...] = ("seed",)
) -> dict[tuple, dict[str, dict[str, float]]]:
    """(group values) -> pairing unit -> values. The unit is the seed, or with ``unit=("experiment", "seed")`` the
    experiment and the seed (experiments pooled as one sample: e.g. two warm starts, each with seeds 0-2). Two runs of
    one cell with the same unit are refused (one would silently hide the other)."""
    out: dict[tuple, dict[str, dict[str, float]]] = defaultdict(dict)
    for run in runs:
        key = tuple(run["params"].get(g, "-") for g in group)
        pair = "/".join(
            run.get("experiment", "?") if u == "experiment" else run["params"].get(u, "?") for u in unit
        )
        if pair in out[key]:
            raise SystemExit(
                f"two finished runs of cell {' '.join(key)!r} share the pairing unit {pair!r} ({'/'.join(unit)}): "
                "delete the duplicate, or pair by more (--unit experiment,seed pools experiments apart)"
            )
        out[key][pair] = run["values"]
    return out


def mean_interval(xs: list[float]) -> str:
    if not xs:
        return "-"
    if len(xs) < 2:
        return f"{xs[0]:.3f} [1]"
    from ais_lightning.toolkit.report.intervals import mean_half_width

    return f"{statistics.fmean(xs):.3f} ± {mean_half_width(statistics.stdev(xs), len(xs)):.3f} [{len(xs)}]"


def paired(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]], metric: str) -> dict[str, float]:
    """a - b over the pairing units (seeds, or experiment/seed) both have."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s][metric] - b[s][metric] for s in seeds if metric in a[s] and metric in b[s]]
    mean, half, n = paired_interval(diffs)
    se = statistics.stdev(diffs) / math.sqrt(n) if n >= 2 else float("nan")
    return {"mean": mean, "se": se, "half_width": half, "n": n}


def show(d: dict[str, float]) -> str:
    if not math.isfinite(d["mean"]):
        return "-"
    mark = " **> 2 SE**" if math.isfinite(d["se"]) and abs(d["mean"]) > 2 * d["se"] > 0 else ""
    return f"{d['mean']:+.3f} (SE {d['se']:.3f}; ±{d['half_width']:.3f}) [{d['n']}]{mark}"


def differences(
    table: dict[tuple, dict[str, dict[str, float]]],
    group: list[str],
    axis_name: str,
    base_value: str,
    metric: str,
    title: str,
    unit: str = "seed",
) -> dict[str, dict[str, float]]:
    """Print and return every cell minus the cell that differs only in ``axis_name`` = ``base_value``, paired by
    ``unit`` (cells without such a twin are left out)."""
    axis = group.index(axis_name)
    print(f"\n### {title}, paired by {unit}: {metric}\n")
    print("| " + " | ".join(group) + " | difference |")
    print("|" + " --- |" * (len(group) + 1))
    out = {}
    for key in sorted(table):
        base = key[:axis] + (base_value,) + key[axis + 1 :]
        if key[axis] != base_value and base in table:
            out[" ".join(key)] = d = paired(table[key], table[base], metric)
            print("| " + " | ".join(key) + f" | {show(d)} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tracking-uri", required=True)
    parser.add_argument("--experiment", action="append", required=True, help="repeatable: pooled")
    parser.add_argument("--group", default="rollout,corrector,algorithm.max_staleness")
    parser.add_argument("--metric", default="acc_trainer", choices=sorted(METRICS))
    parser.add_argument(
        "--unit",
        default="seed",
        help="what pairs two cells' runs: seed, or experiment,seed to pool several experiments' seeds as one sample",
    )
    parser.add_argument(
        "--baseline-param", default="algorithm.max_staleness", help="the staleness table's axis"
    )
    parser.add_argument("--baseline-value", default="0")
    parser.add_argument("--curve", action="store_true", help="also the learning curve by quarters of the run")
    parser.add_argument(
        "--corrector-baseline", default="none", help="the corrector the recovery table subtracts (e.g. tis)"
    )
    parser.add_argument(
        "--pair",
        nargs=2,
        action="append",
        metavar=("A", "B"),
        help="repeatable: cell A minus cell B, paired by seed, on the metric and reward_last50 "
        "(cells named by their group values, space-separated, e.g. 'fp4 ais 4 True' 'fp4 tis 4 False')",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs = [r for e in args.experiment for r in load(args.tracking_uri, e)]
    group = args.group.split(",")
    table = cells(runs, group, tuple(args.unit.split(",")))
    m = args.metric
    print(
        f"## {', '.join(args.experiment)}: {len(runs)} finished runs; metric {m} ({METRICS[m][0]}, {METRICS[m][1]})\n"
    )
    print("| " + " | ".join(group) + f" | {m} | reward (last 50) | KL precision | KL staleness | lambda |")
    print("|" + " --- |" * (len(group) + 5))
    report: dict[str, Any] = {"cells": {}, "staleness_cost": {}, "corrector_gain": {}}
    for key in sorted(table):

        def col(name: str, seeds: dict[str, dict[str, float]] = table[key]) -> list[float]:
            return [v[name] for v in seeds.values() if name in v]

        def fmt(xs: list[float]) -> str:
            return f"{statistics.fmean(xs):.2e}" if xs else "-"

        print(
            "| " + " | ".join(key) + f" | {mean_interval(col(m))} | {mean_interval(col('reward_last50'))} | "
            f"{fmt(col('kl_precision'))} | {fmt(col('kl_staleness'))} | {mean_interval(col('lambda'))} |"
        )
        report["cells"][" ".join(key)] = {name: col(name) for name in METRICS}
    if args.baseline_param in group:
        title = f"The cost of {args.baseline_param} (minus {args.baseline_value})"
        report["staleness_cost"] = differences(
            table, group, args.baseline_param, args.baseline_value, m, title, args.unit
        )
    if "corrector" in group:
        title = f"What a corrector recovers (minus {args.corrector_baseline})"
        report["corrector_gain"] = differences(
            table, group, "corrector", args.corrector_baseline, m, title, args.unit
        )
    for a, b in args.pair or []:
        ka, kb = tuple(a.split()), tuple(b.split())
        missing = [k for k in (ka, kb) if k not in table]
        if missing:
            raise SystemExit(
                f"--pair: no cell {' '.join(missing[0])!r}; cells: {[' '.join(k) for k in sorted(table)]}"
            )
        diffs = {name: paired(table[ka], table[kb], name) for name in (m, "reward_last50")}
        report.setdefault("pairs", {})[f"{a} - {b}"] = diffs
        print(
            f"\n{a} minus {b}, paired by {args.unit}: "
            + "; ".join(f"{n} {show(d)}" for n, d in diffs.items())
        )
    if args.curve:
        print("\n### Learning curve: mean reward over each quarter of the steps\n")
        print("| " + " | ".join(group) + " | " + " | ".join(f"reward_q{q}" for q in range(1, 5)) + " |")
        print("|" + " --- |" * (len(group) + 4))
        for key in sorted(table):
            quarters = [
                [v[f"reward_q{q}"] for v in table[key].values() if f"reward_q{q}" in v] for q in range(1, 5)
            ]
            print("| " + " | ".join(key) + " | " + " | ".join(mean_interval(xs) for xs in quarters) + " |")
    pipeline = ("step_s", "idle_s", "publish_s", "worker_sync_s")
    if any(name in v for seeds in table.values() for v in seeds.values() for name in pipeline[1:]):
        print("\n### The pipeline (Ray workers): mean seconds per step\n")
        print("| " + " | ".join(group) + " | " + " | ".join(pipeline) + " |")
        print("|" + " --- |" * (len(group) + len(pipeline)))
        for key in sorted(table):
            cols = [[v[n] for v in table[key].values() if n in v] for n in pipeline]
            if not any(cols[1:]):
                continue  # no workers in this cell
            print("| " + " | ".join(key) + " | " + " | ".join(mean_interval(xs) for xs in cols) + " |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
