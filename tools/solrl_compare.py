"""Compare Sol-RL runs with GRPO runs at equal steps and at equal training time (docs/solrl.md).

Usage:
  .venv/bin/python tools/solrl_compare.py --tracking-uri sqlite:///multirun/.../mlflow.db \\
      --experiment solrl_small --out reports/solrl [--group-by algorithm,rollout.precision,corrector] \\
      [--budget-s 300]

Reads the FINISHED runs of one MLflow experiment (any mix of ``algorithm=grpo`` and ``algorithm=solrl``
runs of ``ais-train``), groups them into configurations (seeds averaged: mean ± sample std) and writes
report.md, report.json and PNGs of validation accuracy and reward against steps and against training
seconds. Training seconds of a step are the sum of its logged phase times (STEP_TIMES: generation in
each engine, selection, log-probs, update, weight syncs; validation excluded); a run's accuracy at the
time budget is its last validation at or before that many cumulative training seconds (default budget:
the shortest configuration's mean training time). Exit status 2 when there is nothing to report.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from ais_lightning.toolkit.report import ReportError, RunRecord, load_runs, split_finished

PHASES: dict[str, tuple[str, ...]] = {
    "cheap_gen": ("time/screen_s",),
    "exact_gen": ("time/regen_s", "time/regen_sync_s"),
    "select": ("time/select_s",),
    "logprob": ("time/logprob_s",),
    "update": ("time/update_s",),
    "sync": ("time/sync_s",),
}
"""Where a step's time goes, by phase: metric keys summed. A GRPO run's generation is ``time/rollout_s``
(in the cheap engine unless it runs at the trainer's precision, see :func:`run_summary`)."""
STEP_TIMES = tuple(k for keys in PHASES.values() for k in keys) + ("time/rollout_s",)
SOLRL_KEYS = (
    "solrl/informative_frac",
    "solrl/token_agreement",
    "solrl/identical_frac",
    "solrl/shared_token_frac",
    "solrl/reward_agreement",
)
VAL_KEYS = ("val/accuracy_trainer", "val/accuracy_engine")
REWARD_KEY = "reward/mean"
DEFAULT_GROUP_BY = ("algorithm", "rollout.precision", "corrector")


def _by_step(history: list[tuple[int, float]]) -> dict[int, float]:
    return {int(step): float(value) for step, value in history}


def cumulative_seconds(run: RunRecord) -> dict[int, float]:
    """Training seconds up to and including each logged training step.  ``{step: seconds}``

    A Sol-RL step logs ``time/rollout_s`` = screening + regeneration: it is counted once, through the
    phase keys, not twice.
    """
    solrl = "time/screen_s" in run.histories
    keys = [k for k in STEP_TIMES if not (solrl and k == "time/rollout_s")]
    per_step: dict[int, float] = {}
    for key in keys:
        for step, value in run.histories.get(key, []):
            if math.isfinite(value):
                per_step[int(step)] = per_step.get(int(step), 0.0) + value
    total, out = 0.0, {}
    for step in sorted(per_step):
        total += per_step[step]
        out[step] = total
    return out


def value_within(history: list[tuple[int, float]], seconds: dict[int, float], budget: float) -> float:
    """The last value of ``history`` logged at a step whose cumulative training seconds are <= ``budget``
    (validation before training, step 0, always counts); NaN when there is none."""
    best = float("nan")
    for step, value in sorted(history):
        spent = max((s for k, s in seconds.items() if k <= step), default=0.0)
        if spent <= budget + 1e-9:
            best = float(value)
    return best


def run_summary(run: RunRecord, budget_s: float | None = None) -> dict[str, float]:
    """One run's numbers: steps, training seconds, phase shares, final and in-budget accuracy, Sol-RL
    means."""
    seconds = cumulative_seconds(run)
    total = max(seconds.values(), default=0.0)
    out: dict[str, float] = {"steps": float(len(seconds)), "train_s": total}
    out["s_per_step"] = total / len(seconds) if seconds else float("nan")
    solrl = "time/screen_s" in run.histories
    exact_rollouts = run.params.get("rollout.precision") == "fp32"
    for phase, keys in PHASES.items():
        spent = sum(v for k in keys for _, v in run.histories.get(k, []) if math.isfinite(v))
        if not solrl and phase == ("exact_gen" if exact_rollouts else "cheap_gen"):
            spent += sum(v for _, v in run.histories.get("time/rollout_s", []) if math.isfinite(v))
        out[f"share/{phase}"] = spent / total if total > 0 else float("nan")
    for key in VAL_KEYS:
        history = run.histories.get(key, [])
        out[f"{key}@end"] = history[-1][1] if history else float("nan")
        if budget_s is not None:
            out[f"{key}@budget"] = value_within(history, seconds, budget_s)
    rewards = [v for _, v in run.histories.get(REWARD_KEY, [])]
    out["reward@end"] = statistics.fmean(rewards[-10:]) if rewards else float("nan")
    for key in SOLRL_KEYS:
        values = [v for _, v in run.histories.get(key, []) if math.isfinite(v)]
        out[key] = statistics.fmean(values) if values else float("nan")
    return out


def _mean_std(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return float("nan"), float("nan")
    return statistics.fmean(finite), (statistics.stdev(finite) if len(finite) > 1 else 0.0)


def compare(
    runs: list[RunRecord],
    group_by: list[str] | tuple[str, ...] = DEFAULT_GROUP_BY,
    budget_s: float | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Configurations (``group_by`` params) with every number as ``[mean, std]`` over their runs, and the
    time budget used (``budget_s``, else the shortest configuration's mean training seconds)."""
    if not runs:
        raise ReportError("no runs to compare")
    keys = [k for k in group_by if any(k in r.params for r in runs)]
    groups: dict[tuple[str, ...], list[RunRecord]] = {}
    for run in runs:
        groups.setdefault(tuple(run.params.get(k, "-") for k in keys), []).append(run)
    if budget_s is None:
        budget_s = min(
            statistics.fmean(run_summary(r)["train_s"] for r in members) for members in groups.values()
        )
    rows = []
    for config, members in sorted(groups.items()):
        summaries = [run_summary(r, budget_s) for r in members]
        row: dict[str, Any] = {"config": dict(zip(keys, config)), "runs": len(members)}
        for name in summaries[0]:
            row[name] = list(_mean_std([s[name] for s in summaries]))
        rows.append(row)
    return rows, float(budget_s)


COLUMNS = (
    ("steps", "steps", "{:.0f}"),
    ("train_s", "train s", "{:.0f}"),
    ("s_per_step", "s/step", "{:.2f}"),
    ("val/accuracy_trainer@end", "acc fp32 (end)", "{:.3f}"),
    ("val/accuracy_engine@end", "acc engine (end)", "{:.3f}"),
    ("val/accuracy_trainer@budget", "acc fp32 (budget)", "{:.3f}"),
    ("reward@end", "reward (last 10)", "{:.3f}"),
    ("solrl/informative_frac", "informative", "{:.2f}"),
    ("solrl/token_agreement", "token agree", "{:.3f}"),
    ("solrl/identical_frac", "rows identical", "{:.2f}"),
    ("share/cheap_gen", "cheap gen", "{:.0%}"),
    ("share/exact_gen", "fp32 gen", "{:.0%}"),
    ("share/select", "select", "{:.0%}"),
    ("share/logprob", "logprob", "{:.0%}"),
    ("share/update", "update", "{:.0%}"),
    ("share/sync", "sync", "{:.0%}"),
)


def _cell(stat: list[float], fmt: str, runs: int) -> str:
    mean, std = stat
    if not math.isfinite(mean):
        return "-"
    return fmt.format(mean) + (f" ± {fmt.format(std)}" if runs > 1 and "%" not in fmt else "")


def markdown(rows: list[dict[str, Any]], budget_s: float) -> str:
    head = ["configuration", "runs", *(title for _, title, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        name = ", ".join(f"{k}={v}" for k, v in row["config"].items())
        cells = [_cell(row.get(key, [math.nan, math.nan]), fmt, row["runs"]) for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join([name, str(row["runs"]), *cells]) + " |")
    lines += [
        "",
        f"Time budget for the (budget) column: {budget_s:.0f} training seconds. Shares are of a run's "
        "training seconds (validation excluded); cheap gen = the rollout engine's generation, fp32 gen = "
        "generation at the "
        "trainer's precision (Sol-RL's regeneration and weight sync, or a fp32 GRPO run's rollouts).",
    ]
    return "\n".join(lines) + "\n"


def plot(runs: list[RunRecord], group_by: list[str] | tuple[str, ...], out: Path) -> list[Path]:
    """Validation accuracy (trainer precision) and reward against step and against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in group_by if any(k in r.params for r in runs)]
    written = []
    for metric in ("val/accuracy_trainer", REWARD_KEY):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for run in runs:
            history = run.histories.get(metric, [])
            if not history:
                continue
            seconds = cumulative_seconds(run)
            label = ",".join(run.params.get(k, "-") for k in keys) + f" s{run.params.get('seed', '?')}"
            steps = [s for s, _ in history]
            spent = [max((t for k, t in seconds.items() if k <= s), default=0.0) for s in steps]
            values = [v for _, v in history]
            axes[0].plot(steps, values, label=label)
            axes[1].plot(spent, values, label=label)
        axes[0].set_xlabel("step")
        axes[1].set_xlabel("training seconds")
        for ax in axes:
            ax.set_ylabel(metric)
        axes[1].legend(fontsize=6)
        path = out / f"{metric.replace('/', '_')}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tracking-uri", required=True, help="MLflow tracking URI (sqlite:///..., http://...)"
    )
    parser.add_argument("--experiment", required=True, help="MLflow experiment name (or id)")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--group-by", default=",".join(DEFAULT_GROUP_BY), help="comma-separated params")
    parser.add_argument("--budget-s", type=float, default=None, help="training-time budget in seconds")
    args = parser.parse_args(argv)
    group_by = [k.strip() for k in args.group_by.split(",") if k.strip()]
    try:
        runs = load_runs(args.tracking_uri, args.experiment, extra_keys=(*STEP_TIMES, *SOLRL_KEYS, *VAL_KEYS))
        finished, _ = split_finished(runs, args.experiment)
        rows, budget = compare(finished, group_by, args.budget_s)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, budget)
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps({"budget_s": budget, "rows": rows}, indent=1, default=str))
    plot(finished, group_by, out)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
