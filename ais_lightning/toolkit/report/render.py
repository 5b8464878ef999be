"""Rendering: the aggregated rows as a markdown table and report, JSON-able data, and PNG plots.

matplotlib is imported only when a plot is drawn (Agg backend).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from ais_lightning.toolkit.report import stats
from ais_lightning.toolkit.report.records import RunRecord
from ais_lightning.toolkit.report.stats import COLUMNS, SEED_PARAM, Row, Stat


def format_stat(stat: Stat, fmt: str, runs: int | None = None) -> str:
    """``"0.450 ± 0.635"``: the mean ± the half-width of its 95% t-interval; ``"0.450"`` for one run, ``"-"`` when no
    run logged it; ``" (2)"`` appended when fewer values than the row's ``runs`` make it."""
    if stat.n == 0:
        return "-"
    text = fmt.format(stat.mean)
    if stat.n > 1:
        text += " ± " + fmt.replace("+", "").format(stat.half_width)  # a sign flag is for the mean only
    if runs is not None and stat.n != runs:
        text += f" ({stat.n})"
    return text


def markdown_table(rows: list[Row]) -> str:
    """The table: group keys, n seeds, COLUMNS (mean ± 95% t-interval), and "gap recovered" when any row has one."""
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
        cells += [format_stat(row.stats[col], fmt, len(row.run_ids)) for col, _, fmt in COLUMNS]
        if with_gap:
            cells.append("-" if row.gap_recovered is None else f"{row.gap_recovered:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _definitions() -> str:
    """The column and gap-recovered definitions (the docstring of :mod:`ais_lightning.toolkit.report.stats`)."""
    doc = stats.__doc__ or ""
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
                    **{col: _stat_dict(r.stats[col]) for col, _, _ in COLUMNS},
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


def _stat_dict(stat: Stat) -> dict[str, Any]:
    """A :class:`Stat` as JSON-able data: its fields and ``half_width``, the 95% t-interval's."""
    return {**dataclasses.asdict(stat), "half_width": stat.half_width}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")
