"""The end-of-run summary: printed, saved as JSON and a PNG, and logged to MLflow."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def summarize(history: list[dict[str, float]], window: int = 10) -> dict[str, Any]:
    """Reward first -> last (means over ``window`` steps), mismatch KL, lambda trajectory."""
    if not history:
        return {"steps": 0}
    window = max(1, min(window, len(history) // 2 or 1))
    rewards = [h["reward"] for h in history]
    lambdas = [h.get("lambda", float("nan")) for h in history]
    picks = sorted({0, len(history) // 4, len(history) // 2, 3 * len(history) // 4, len(history) - 1})
    return {
        "steps": len(history),
        "reward_first": _mean(rewards[:window]),
        "reward_last": _mean(rewards[-window:]),
        "reward_gain": _mean(rewards[-window:]) - _mean(rewards[:window]),
        "kl_k3_mean": _mean([h.get("kl_k3", float("nan")) for h in history]),
        "kl_k3_last": history[-1].get("kl_k3", float("nan")),
        "entropy_first": history[0].get("entropy", float("nan")),
        "entropy_last": history[-1].get("entropy", float("nan")),
        "lambda_trajectory": {
            int(history[i]["step"]): lambdas[i] for i in picks if math.isfinite(lambdas[i])
        },
        "reward_failures": int(sum(h.get("reward_failed", 0.0) for h in history)),
    }


def format_summary(summary: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
    """Human-readable block for the terminal."""
    lines = ["", "=" * 64, "ais-train summary", "=" * 64]
    if summary.get("steps", 0) == 0:
        lines.append("no training steps were run")
    else:
        lines += [
            f"steps                 {summary['steps']}",
            f"reward (first -> last) {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}"
            f"  ({summary['reward_gain']:+.3f})",
            f"mismatch KL k3        mean {summary['kl_k3_mean']:.2e}, last {summary['kl_k3_last']:.2e}",
            f"entropy               {summary['entropy_first']:.3f} -> {summary['entropy_last']:.3f}",
        ]
        if summary["lambda_trajectory"]:
            traj = "  ".join(f"{s}:{v:.3f}" for s, v in summary["lambda_trajectory"].items())
            lines.append(f"AIS lambda (step:val)  {traj}")
        if summary.get("reward_failures"):
            lines.append(
                f"WARNING               the reward function failed on {summary['reward_failures']} samples "
                "(scored 0; its errors are in the log)"
            )
    if summary.get("status", "finished") != "finished":
        lines.append(f"STATUS                {summary['status'].upper()}: the run did not reach max_steps")
    for key, value in (extra or {}).items():
        lines.append(f"{key:<22}{value}")
    lines.append("=" * 64)
    return "\n".join(lines)


def plot_history(history: list[dict[str, float]], path: str | Path) -> Path | None:
    """Reward, mismatch KL, entropy and lambda vs step in one PNG (None if nothing to plot)."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    panels = [
        ("reward", "reward"),
        ("kl_k3", "mismatch KL (k3)"),
        ("entropy", "entropy"),
        ("lambda", "AIS lambda"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3))
    for ax, (key, title) in zip(axes, panels):
        ax.plot(steps, [h.get(key, float("nan")) for h in history])
        ax.set_title(title)
        ax.set_xlabel("rollout step")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_summary(
    summary: dict[str, Any], history: list[dict[str, float]], output_dir: str | Path
) -> list[Path]:
    """``summary.json``, ``history.json`` and ``summary.png`` in ``output_dir``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "summary.json", out / "history.json"]
    files[0].write_text(json.dumps(summary, indent=2))
    files[1].write_text(json.dumps(history, indent=1))
    png = plot_history(history, out / "summary.png")
    return files + ([png] if png else [])
