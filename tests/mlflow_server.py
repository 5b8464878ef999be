"""A real MLflow tracking server on 127.0.0.1 for tests: ``ais_lightning.toolkit.mlflow_server``'s, under a test's tmp dir."""

from __future__ import annotations

from ais_lightning.toolkit.mlflow_server import free_port, local_mlflow_server

mlflow_server = local_mlflow_server

__all__ = ["free_port", "mlflow_server"]
