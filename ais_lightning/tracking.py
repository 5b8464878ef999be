"""Experiment tracking: where MLflow runs go and what each run records.

Default store: a SQLite database (MLflow >= 3.7's default backend) under the run's output
directory, or under the sweep directory for a Hydra multirun so that all jobs of one sweep land
as runs of one experiment in one store. ``logger.tracking_uri`` or ``$MLFLOW_TRACKING_URI``
points at a server instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


def default_store_root(output_dir: str) -> Path:
    """The sweep directory in a Hydra multirun, else the run's output directory."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized():
            hc = HydraConfig.get()
            if hc.mode == RunMode.MULTIRUN:
                return Path(hc.sweep.dir).absolute()
    except ImportError:  # pragma: no cover - hydra is a dependency
        pass
    return Path(output_dir).absolute()


def resolve_tracking_uri(configured: str | None, output_dir: str) -> str:
    """``logger.tracking_uri`` > ``$MLFLOW_TRACKING_URI`` > SQLite under the output/sweep directory."""
    if configured:
        return configured
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = default_store_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def flatten_config(cfg: DictConfig | dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}`` of the resolved config (MLflow params are flat)."""
    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    flat: dict[str, Any] = {}
    for key, value in container.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_config(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


RUN_NAME_EXCLUDED = ("logger.tracking_uri", "ckpt_path")
"""Overrides left out of the default run name: where the run is logged or resumed from, not what it is."""


def run_name_from_overrides() -> str | None:
    """``corrector=ais,rollout=fp8`` from Hydra's task overrides (None outside Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            overrides = [
                o
                for o in HydraConfig.get().overrides.task
                if not o.startswith(("hydra.", "hydra/")) and o.split("=", 1)[0] not in RUN_NAME_EXCLUDED
            ]
            return ",".join(overrides) or "default"
    except ImportError:  # pragma: no cover
        pass
    return None


def build_logger(cfg: DictConfig) -> Any:
    """The Lightning logger for ``cfg.logger`` (MLflow, CSV or none)."""
    name = cfg.logger.name
    if name == "none":
        return False
    if name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=cfg.output_dir, name="csv")
    from lightning.pytorch.loggers import MLFlowLogger

    uri = resolve_tracking_uri(cfg.logger.tracking_uri, cfg.output_dir)
    artifact_location = None
    if uri.startswith("sqlite:///"):
        artifact_location = str(Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts")
    return MLFlowLogger(
        experiment_name=cfg.logger.experiment_name,
        run_name=cfg.logger.run_name or run_name_from_overrides(),
        tracking_uri=uri,
        artifact_location=artifact_location,
        synchronous=True,
    )


def reopen_run(logger: Any) -> None:
    """Mark ``logger``'s MLflow run RUNNING again after a Lightning stage finalized it.

    Lightning finalizes every logger ("success" -> FINISHED) at the end of *each* stage, so a
    ``trainer.validate`` before ``trainer.fit`` leaves the run FINISHED during training: a sweep
    report would average it as done and a killed run would look complete. ``fit`` finalizes it
    again (FINISHED, or FAILED on an exception). No-op for other loggers.
    """
    if logger and hasattr(logger, "run_id") and hasattr(logger, "experiment"):
        logger.experiment.update_run(logger.run_id, status="RUNNING")
