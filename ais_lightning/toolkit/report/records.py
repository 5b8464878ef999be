"""The data the sweep report works on: MLflow runs as :class:`RunRecord`, the metric keys it reads.

Shared by :mod:`ais_lightning.toolkit.report.load` (which builds the records), :mod:`~ais_lightning.toolkit.report.stats`
and :mod:`~ais_lightning.toolkit.report.render`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


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
