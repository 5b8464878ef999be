"""The end-of-run summary: printed, saved as JSON and a PNG, and logged to MLflow."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def constant_reward(history: list[dict[str, float]], tol: float = 1e-6) -> float | None:
    """The one reward every trained sample of every step got (``reward_min``/``reward_max`` of the
    history entries), or None when the rewards varied, a step does not record them, or there is no step."""
    lows = [h.get("reward_min", math.nan) for h in history]
    highs = [h.get("reward_max", math.nan) for h in history]
    if not history or not all(math.isfinite(v) for v in lows + highs):
        return None
    return min(lows) if max(highs) - min(lows) <= tol else None


def never_correct(validations: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``{"validations", "metrics", "example"}`` when some greedy accuracy was 0 at every validation: how many
    validations there were, those accuracies' names and the last validation's example (prompt, completion,
    reference solution); None when every accuracy was above 0 at least once, or without validations."""
    if not validations:
        return None
    names = sorted({k for v in validations for k in v.get("accuracy", {})})
    zero = [n for n in names if all(v.get("accuracy", {}).get(n, 0.0) == 0.0 for v in validations)]
    if not zero:
        return None
    return {
        "validations": len(validations),
        "metrics": zero,
        "example": dict(validations[-1].get("example", {})),
    }


def summarize(
    history: list[dict[str, float]],
    window: int = 10,
    validations: list[dict[str, Any]] | None = None,
    task: str | None = None,
) -> dict[str, Any]:
    """Reward first -> last (means over ``window`` steps), mismatch KL, lambda trajectory, and the reward
    alarms: ``reward_constant`` (the one reward every sample of every step got, else None, see
    :func:`constant_reward`) and ``validation_never_correct`` (:func:`never_correct` of ``validations``,
    ``GRPOModule.validation_history``). ``task`` names the task in the printed warnings."""
    validations = list(validations or [])
    alarms: dict[str, Any] = {
        "task": task,
        "reward_constant": constant_reward(history),
        "validations": len(validations),
        "validation_never_correct": never_correct(validations),
    }
    if not history:
        return {"steps": 0, **alarms}
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
        **_staleness(history),
        **_workers(history),
        **alarms,
    }


def is_asynchronous(history: list[dict[str, float]]) -> bool:
    """Whether the history is an asynchronous run's (its steps record their ``staleness``)."""
    return any("staleness" in h for h in history)


def _staleness(history: list[dict[str, float]]) -> dict[str, float]:
    """An asynchronous run's staleness (versions) and its two KLs, means over the steps; empty for a synchronous
    run."""
    if not is_asynchronous(history):
        return {}
    return {
        "staleness_mean": _mean([h.get("staleness", float("nan")) for h in history]),
        "staleness_max": max(h.get("staleness_max", h.get("staleness", 0.0)) for h in history),  # of any row
        "staleness_dropped": sum(h.get("dropped", 0.0) for h in history),
        "kl_k3_precision_mean": _mean([h.get("kl_k3_precision", float("nan")) for h in history]),
        "kl_k3_staleness_mean": _mean([h.get("kl_k3_staleness", float("nan")) for h in history]),
    }


def _workers(history: list[dict[str, float]]) -> dict[str, float]:
    """A run with rollout workers: the time the trainer waited for rollouts (total and per step) and the workers'
    restarts; empty without workers."""
    waits = [h["rollout_wait_s"] for h in history if "rollout_wait_s" in h]
    if not waits:
        return {}
    return {
        "rollout_wait_s": sum(waits),
        "rollout_wait_per_step_s": sum(waits) / len(waits),
        "worker_restarts": max(h.get("worker_restarts", 0.0) for h in history),
    }


def alarm_lines(summary: dict[str, Any]) -> list[list[str]]:
    """The summary's warnings about a reward that never fired or never changed: one list of lines each."""
    task = f"task {summary['task']!r}" if summary.get("task") else "the task"
    warnings = []
    value = summary.get("reward_constant")
    if value is not None and summary.get("steps", 0):
        what = "never fired (0" if value == 0 else f"was constant ({value:g}"
        warnings.append(
            [
                f"{task}: the training reward {what} on every sample of all {summary['steps']} steps);",
                "GRPO's advantages were all zero, so the run learned nothing",
            ]
        )
    zero = summary.get("validation_never_correct")
    if zero:
        engines = ", ".join(m.removeprefix("val/accuracy_") for m in zero["metrics"])
        lines = [
            f"{task}: validation accuracy was 0 at all {zero['validations']} validation(s) ({engines}):",
            "no greedy answer was read as right",
        ]
        example = zero.get("example") or {}
        if example:
            lines.append(f"e.g. prompt {_clip(example.get('prompt', ''))}")
            lines.append(f"  -> {_clip(example.get('completion', ''))}")
            lines.append(f"  reference {_clip(example.get('solution', ''))}")
        warnings.append(lines)
    if zero:
        warnings[-1].append("check task.format and task.extract (how the answer is asked for and read)")
    elif warnings and summary.get("validations"):  # greedy answers scored: the format can be answered in
        warnings[-1].append(
            "greedy validation answers did score: sample more per step (algorithm.group_size)"
        )
    elif warnings:
        warnings[-1].append(
            "check task.format and task.extract, or sample more per step (algorithm.group_size)"
        )
    return warnings


def _clip(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


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
        if "staleness_mean" in summary:
            lines.append(
                f"staleness (versions)  mean {summary['staleness_mean']:.2f}, max {summary['staleness_max']:.0f}, "
                f"dropped {summary['staleness_dropped']:.0f} rows; KL k3 precision "
                f"{summary['kl_k3_precision_mean']:.2e}, staleness {summary['kl_k3_staleness_mean']:.2e}"
            )
        if "rollout_wait_s" in summary:
            lines.append(
                f"rollout workers       the trainer waited {summary['rollout_wait_s']:.1f} s for rollouts "
                f"({summary['rollout_wait_per_step_s']:.2f} s per step); restarts {summary['worker_restarts']:.0f}"
            )
        if summary["lambda_trajectory"]:
            traj = "  ".join(f"{s}:{v:.3f}" for s, v in summary["lambda_trajectory"].items())
            lines.append(f"AIS lambda (step:val)  {traj}")
        if summary.get("reward_failures"):
            lines.append(
                f"WARNING               the reward function failed on {summary['reward_failures']} samples "
                "(scored 0; its errors are in the log)"
            )
    for warning in alarm_lines(summary):
        lines += [f"{'WARNING' if i == 0 else '':<22}{line}" for i, line in enumerate(warning)]
    if summary.get("status", "finished") != "finished":
        lines.append(f"STATUS                {summary['status'].upper()}: the run did not reach max_steps")
    for key, value in (extra or {}).items():
        lines.append(f"{key:<22}{value}")
    lines.append("=" * 64)
    return "\n".join(lines)


def history_panels(history: list[dict[str, float]]) -> list[tuple[str, dict[str, list[float]]]]:
    """What :func:`plot_history` draws: ``(title, {line label: value per step})`` per panel.

    Reward, mismatch KL (k3), entropy and AIS lambda; an asynchronous run (its history has ``staleness``) adds the
    KL's precision and staleness parts to the KL panel and a panel of the mean staleness against its bound.
    """

    def series(key: str) -> list[float]:
        return [h.get(key, float("nan")) for h in history]

    kl = {"whole": series("kl_k3")}
    asynchronous = is_asynchronous(history)
    if asynchronous:
        kl.update(precision=series("kl_k3_precision"), staleness=series("kl_k3_staleness"))
    panels = [
        ("reward", {"reward": series("reward")}),
        ("mismatch KL (k3)", kl),
        ("entropy", {"entropy": series("entropy")}),
        ("AIS lambda", {"lambda": series("lambda")}),
    ]
    if asynchronous:
        panels.append(
            ("staleness (versions)", {"mean": series("staleness"), "bound": series("staleness_bound")})
        )
    return panels


def plot_history(history: list[dict[str, float]], path: str | Path) -> Path | None:
    """The panels of :func:`history_panels` vs step in one PNG (None if nothing to plot)."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    panels = history_panels(history)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3))
    for ax, (title, lines) in zip(axes, panels):
        for label, values in lines.items():
            ax.plot(steps, values, label=label, linestyle="--" if label == "bound" else "-")
        if len(lines) > 1:
            ax.legend(fontsize="small")
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


def report_run(
    cfg: Any,
    components: Any,
    trainer: Any,
    module: Any,
    logger: Any,
    warm: Any,
    resume: Any,
    status: str,
    recovered: dict[str, float],
    started: float,
    preemption: Any = None,
) -> dict[str, Any]:
    """The end of an ``ais-train`` run: its summary (:func:`summarize`, with the validation before and after,
    the warm start and the wall time since ``started``); on rank 0 also ``summary.json``, ``history.json``,
    ``summary.png`` and ``config.yaml`` in the output directory and in the MLflow run (marked KILLED unless
    ``status`` is ``finished``), and the printed table. ``status``: ``finished``, ``preempted`` (``preemption``,
    the run's :class:`ais_lightning.app.preemption.Preemption`, then says what was saved and requeued) or a
    signal that interrupted the run.
    Returns the summary."""
    import time

    from omegaconf import OmegaConf

    from ais_lightning.app.tracking import is_mlflow

    task = components.task
    summary = summarize(
        module.history,
        validations=module.validation_history,  # a 0 accuracy at every validation
        task=task.name or type(task).__name__,  # named in the summary's reward warnings
    )
    summary["status"] = status if status in ("finished", "preempted") else "interrupted"
    if status == "preempted":
        summary["preemption"] = dict(preemption.outcome)  # {"checkpoint", "requeue"}
    val = {**recovered, **{k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}}
    summary["validation_start"] = dict(module.validation_start)
    if warm is not None:
        summary["warm_start"] = {
            "accuracy": warm.accuracy,
            "eval_size": warm.eval_size,
            "steps": warm.steps,
            "from_cache": warm.from_cache,
            "path": str(warm.path),
        }
    summary["validation"] = val
    summary["wall_time_s"] = time.perf_counter() - started
    if not trainer.is_global_zero:
        return summary
    resumed = f"off (resumed from {resume.ckpt_path})" if resume.ckpt_path else "off"
    extra = {
        "warm-start": warm.describe() if warm else resumed,
        "rollout engine": describe_engine(module.engine),
        "wall time": f"{summary['wall_time_s']:.0f} s",
        **{f"preemption {k}": v for k, v in summary.get("preemption", {}).items() if v},
    }
    for key, value in val.items():
        before = summary["validation_start"].get(key)
        extra[key] = (
            f"{value:.3f}" if before is None else f"{before:.3f} -> {value:.3f} ({value - before:+.3f})"
        )
    files = write_summary(summary, module.history, cfg.output_dir)
    Path(cfg.output_dir, "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    files.append(Path(cfg.output_dir, "config.yaml"))
    if is_mlflow(logger):
        client = logger.experiment
        for key in ("reward_first", "reward_last", "reward_gain", "kl_k3_mean", "wall_time_s"):
            if key in summary:
                client.log_metric(logger.run_id, f"summary/{key}", float(summary[key]))
        for path in files:
            client.log_artifact(logger.run_id, str(path))
        if status != "finished":
            client.set_terminated(logger.run_id, "KILLED")
        experiment = components.logger.experiment_name
        extra["mlflow"] = f"{logger._tracking_uri} (experiment {experiment!r}, run {logger.run_id})"
    extra["outputs"] = str(Path(cfg.output_dir).absolute())
    print(format_summary(summary, extra), flush=True)
    return summary


def describe_engine(engine: Any) -> str:
    """``TorchRolloutEngine int8 (backend fbgemm: fbgemm's int8 GEMM; lean forward)``: the engine class, its
    precision, the quantization backend that ran it (what runs its products) and, for the torch engine, the forward
    it ran (``model_impl``); "not built" before setup."""
    if engine is None:
        return "not built"
    from ais_lightning.quant.linear import BACKEND_KERNELS

    details = []
    backend = getattr(engine, "backend", None)
    if backend is not None:
        details.append(f"backend {backend}: {BACKEND_KERNELS.get(backend, backend)}")
    if engine.model_impl:
        details.append(f"{engine.model_impl} forward")
    text = f"{type(engine).__name__} {engine.precision or ''}".strip()
    return f"{text} ({'; '.join(details)})" if details else text
