"""Experiment tracking: where MLflow runs go and what each run records.

Default store: a SQLite database (MLflow >= 3.7's default backend) under the run's output
directory, or under the sweep directory for a Hydra multirun so that all jobs of one sweep land
as runs of one experiment in one store. ``logger.tracking_uri`` or ``$MLFLOW_TRACKING_URI``
points at a server instead.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ais_lightning.app.store_client import StoreClient, store_lock
from ais_lightning.checks import check_int

LOGGERS = ("mlflow", "csv", "none")


@dataclass
class LoggerSettings:
    """Experiment tracking (the ``logger`` group of ``ais-train``); each default lives here only."""

    name: str = "mlflow"
    """mlflow | csv | none."""
    experiment_name: str = "ais_lightning"
    """MLflow experiment."""
    run_name: str | None = None
    """MLflow run name (default: the run's command-line overrides)."""
    tracking_uri: str | None = None
    """MLflow tracking URI; None = $MLFLOW_TRACKING_URI, else a SQLite store under the output directory."""
    request_retries: int | None = None
    """Retries of a request to a tracking server before the run gives up on it (None:
    ``$MLFLOW_HTTP_REQUEST_MAX_RETRIES`` if set, else 3; MLflow's own default of 7 with its backoff retried for
    minutes). :mod:`ais_lightning.app.store_client`."""
    request_timeout_s: int | None = None
    """Seconds a tracking server has to answer one request (None: ``$MLFLOW_HTTP_REQUEST_TIMEOUT`` if set, else
    20; MLflow's own default is 120)."""

    def __post_init__(self) -> None:
        if self.name not in LOGGERS:
            raise ValueError(f"name must be one of {list(LOGGERS)}, got {self.name!r}")
        if not self.experiment_name:
            raise ValueError("experiment_name must be a non-empty string")
        if self.request_retries is not None:
            check_int(self.request_retries, "request_retries", 0)
        if self.request_timeout_s is not None:
            check_int(self.request_timeout_s, "request_timeout_s", 1)


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
    return sqlite_uri(root / "mlflow.db")


def sqlite_uri(db: str | os.PathLike) -> str:
    """The ``sqlite:///`` URI of the SQLite file ``db`` (made absolute), its path percent-quoted.

    SQLAlchemy, which opens MLflow's SQLite stores, reads a URI as a URL: an unquoted ``?`` starts a query
    (the path is cut there), ``#`` a fragment and ``%41`` is decoded to ``A``. Quoting keeps every path as
    it is, spaces and non-ASCII included; :func:`sqlite_path` reads it back.
    """
    from urllib.parse import quote

    return "sqlite:///" + quote(str(Path(db).absolute()))


def sqlite_path(uri: str) -> Path | None:
    """The database file a ``sqlite:///`` URI names, read as SQLAlchemy reads it (percent-decoded, a query
    dropped); None for servers and other stores."""
    if not uri.startswith("sqlite:///"):
        return None
    from sqlalchemy.engine import make_url

    return Path(make_url(uri).database or "")


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


RUN_NAME_EXCLUDED = ("logger.tracking_uri", "ckpt_path", "overwrite")
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


def sqlite_lock_path(uri: str) -> Path | None:
    """``<db>.lock`` beside a ``sqlite:///`` store; None for servers and other stores."""
    db = sqlite_path(uri)
    return None if db is None else db.with_name(db.name + ".lock")


def build_logger(settings: LoggerSettings, output_dir: str, resume: dict[str, str] | None = None) -> Any:
    """The Lightning logger for ``settings`` (MLflow, CSV, or False for none).

    ``resume``: the MLflow run a checkpoint belongs to (:func:`ais_lightning.app.resume.mlflow_run_of`); its run continues, in the
    store it was logged to unless ``settings``/``$MLFLOW_TRACKING_URI`` name another store explicitly.
    """
    if settings.name == "none":
        return False
    if settings.name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=output_dir, name="csv")
    from lightning.pytorch.loggers import MLFlowLogger

    uri, run_id = logger_target(settings, output_dir, resume)
    db = sqlite_path(uri)
    artifact_location = None if db is None else (db.parent / "mlartifacts").absolute().as_uri()
    lock = sqlite_lock_path(uri)
    with store_lock(lock), _environment_kept("MLFLOW_TRACKING_URI"), _no_quoted_twin(uri):
        logger = MLFlowLogger(
            experiment_name=settings.experiment_name,
            run_name=settings.run_name or run_name_from_overrides(),
            tracking_uri=uri,
            artifact_location=artifact_location,
            run_id=run_id,
            synchronous=True,
        )
        _start_run(logger)
    logger._mlflow_client = StoreClient(logger._mlflow_client, lock, server=None if db else uri)
    return logger


@contextlib.contextmanager
def _no_quoted_twin(uri: str) -> Iterator[None]:
    """Remove the empty directory MLflow creates under the still-quoted path of a ``sqlite:///`` URI.

    MLflow makes the store's parent directory from the URI's text without decoding it
    (``mlflow.store.db.utils._make_parent_dirs_if_sqlite``): a store under ``run ?1`` gets an empty twin
    ``run%20%3F1`` beside it. Removed after the block if the block created it (and it is still empty).
    """
    db = sqlite_path(uri)
    twin = Path(uri.removeprefix("sqlite:///")).parent
    created = db is not None and twin != db.parent and not twin.exists()
    try:
        yield
    finally:
        if created:
            with contextlib.suppress(OSError):
                os.removedirs(twin)  # the twin and its new parents, up to the first directory not empty


@contextlib.contextmanager
def _environment_kept(name: str) -> Iterator[None]:
    """Restore the environment variable ``name`` after the block.

    A new run's ``MLFlowLogger`` calls ``mlflow.set_tracking_uri``, which also exports ``$MLFLOW_TRACKING_URI``:
    a second run in the same process (a notebook, Hydra's in-process multirun, a test) would take the first
    run's store for the user's explicit choice, and a resume would start a new run there instead of
    continuing its checkpoint's run.
    """
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _start_run(logger: Any) -> None:
    """Get or create the experiment and create (or look up) the run now.

    ``MLFlowLogger`` does it lazily with two store calls (get the experiment by name, else create it): two
    jobs of a parallel sweep can both find no experiment and both create it, and the second fails
    ("Experiment(name=...) already exists"). :func:`build_logger` calls this under the store lock (SQLite);
    for a server, where there is no lock, the loser of the race finds the experiment on a second look.
    """
    from mlflow.exceptions import MlflowException

    try:
        client = logger._mlflow_client
        if logger._run_id is None and client.get_experiment_by_name(logger._experiment_name) is None:
            # created here, quietly: MLFlowLogger would warn "Experiment ... not found. Creating it."
            client.create_experiment(logger._experiment_name, artifact_location=logger._artifact_location)
        _ = logger.experiment
    except MlflowException as err:
        if getattr(err, "error_code", "") != "RESOURCE_ALREADY_EXISTS" and "already exists" not in str(err):
            raise
        _ = logger.experiment  # the experiment another job created meanwhile


def logger_target(
    settings: LoggerSettings, output_dir: str, resume: dict[str, Any] | None = None
) -> tuple[str, str | None]:
    """``(tracking URI, run id to continue or None)`` of the MLflow logger :func:`build_logger` builds.

    A resumed run continues the checkpoint's run in the store it was logged to (or starts a new one there
    when ``resume["run_id"]`` is None: a resume that changed the recipe), unless ``logger.tracking_uri`` or
    ``$MLFLOW_TRACKING_URI`` name another store (then a new run starts there).
    """
    explicit = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if resume and (not explicit or explicit == resume.get("tracking_uri")):
        return resume["tracking_uri"], resume.get("run_id")
    return resolve_tracking_uri(settings.tracking_uri, output_dir), None


def check_tracking_uri(
    settings: LoggerSettings,
    output_dir: str,
    resume: dict[str, Any] | None = None,
    timeout_s: float = 5.0,
) -> None:
    """Fail now, naming where the URI comes from, if the MLflow store cannot be reached or written.

    The store checked is the one the run will log to (:func:`logger_target`; for a resume, the store of
    the checkpoint's run). An HTTP(S) server must answer its ``/health`` endpoint within ``timeout_s``
    (MLflow's own client would retry for minutes, after the warm start); a SQLite store's directory must
    be writable, an existing store must read and take a write lock (:func:`check_sqlite_store`), and a
    resumed run's SQLite store must exist; a file store must be one this MLflow opens.
    """
    if settings.name != "mlflow":
        return
    uri, _ = logger_target(settings, output_dir, resume)
    hint = ""
    if resume is not None and uri == resume.get("tracking_uri"):  # the checkpoint's store
        key, where = "ckpt_path's MLflow store", f"ckpt_path's MLflow run is logged at {uri}, which"
        hint = "; set logger.tracking_uri to log the resumed run to another store"
        if sqlite_path(uri) is not None and not sqlite_path(uri).is_file():
            raise ValueError(f"{where} does not exist{hint}")
    else:
        if settings.tracking_uri:
            key = "logger.tracking_uri"
        elif os.environ.get("MLFLOW_TRACKING_URI"):
            key = "$MLFLOW_TRACKING_URI"
        else:
            key = "output_dir"  # the default store, under the output (or sweep) directory
        where = f"{key}={uri}"
    if uri.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as response:
                ok = response.status == 200
        except (urllib.error.URLError, OSError) as err:
            raise ValueError(
                f"{where} is not reachable (no MLflow server answered /health: {err}){hint}"
            ) from err
        if not ok:
            raise ValueError(f"{where} answered /health with HTTP {response.status}{hint}")
    elif (db := sqlite_path(uri)) is not None:
        check_writable(db.parent, key)
        if db.is_file():
            check_sqlite_store(db, where)
    elif _is_file_store(uri):
        _check_file_store(uri, where)


def check_sqlite_store(db: Path, where: str, timeout_s: float = 5.0) -> None:
    """ValueError naming ``where`` unless the existing SQLite store ``db`` reads as a database and can be
    written: its header read, a write lock taken and given back (holding the store lock, so only another
    program can hold it for ``timeout_s``). A corrupt or locked store used to be found after the model was built."""
    import sqlite3

    with store_lock(sqlite_lock_path(sqlite_uri(db))):
        try:
            connection = sqlite3.connect(db, timeout=timeout_s)
            try:
                connection.execute("PRAGMA schema_version").fetchone()
                connection.execute("BEGIN IMMEDIATE")
                connection.rollback()
            finally:
                connection.close()
        except sqlite3.Error as err:
            if "locked" in str(err):
                raise ValueError(
                    f"{where}: {db} is locked by another program for over {timeout_s:g} s ({err}): close it (an "
                    "sqlite3 shell, a database browser) or set logger.tracking_uri to another store"
                ) from err
            raise ValueError(
                f"{where}: {db} is not a readable SQLite database ({err}): move it away, or set "
                "logger.tracking_uri to another store"
            ) from err


def _is_file_store(uri: str) -> bool:
    """``file:...`` or a plain path (``./mlruns``, ``C:\\runs``); not ``databricks`` or another scheme."""
    from urllib.parse import urlparse

    scheme = urlparse(uri).scheme
    return scheme == "file" or (len(scheme) <= 1 and not uri.startswith("databricks"))


def _check_file_store(uri: str, where: str) -> None:
    """Open a file store (``./mlruns``, ``file:...``) now: recent MLflow refuses one unless
    ``$MLFLOW_ALLOW_FILE_STORE`` is set, which used to surface as a traceback after the warm start."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        MlflowClient(tracking_uri=uri)  # builds the store, as the logger will
    except MlflowException as err:
        raise ValueError(
            f"{where} is a file store, which this MLflow refuses ({err.message.split('. ')[0]}); use a "
            "SQLite store (sqlite:///path/to/mlflow.db) or an http:// server, or set "
            "MLFLOW_ALLOW_FILE_STORE=true"
        ) from err


def check_writable(directory: Path, key: str) -> None:
    """Raise ValueError naming ``key`` unless ``directory`` can be created and written to."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as err:
        raise ValueError(f"{key}: {directory} is not writable ({err})") from err


def option_choices() -> dict[str, str]:
    """The option picked in each config group (``{"corrector": "tis_seq", ...}``), from Hydra; {} outside it.

    Logged as MLflow params named after the groups, so runs group by the names a user typed.
    """
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return {
                group: str(choice)
                for group, choice in HydraConfig.get().runtime.choices.items()
                if not group.startswith(("hydra", "schema")) and choice is not None
            }
    except ImportError:  # pragma: no cover
        pass
    return {}


def engine_params(engine: Any) -> dict[str, str]:
    """``{"engine/precision": "int8", "engine/backend": "fbgemm", "engine/cpu_int8": "avx2"}``: the precision and
    quantization backend the rollout engine runs, as its class resolved them on this host (``rollout.backend=null``
    is the CPU's fastest exact kernel), and what the CPU multiplies int8 with
    (:func:`ais_lightning.quant.cpu_int8.cpu_int8_isa`); {} without an engine spec."""
    checked = getattr(engine, "checked_arguments", None)
    if checked is None:
        return {}
    from ais_lightning.quant.cpu_int8 import cpu_int8_isa

    params = {f"engine/{key}": str(checked[key]) for key in ("precision", "backend") if key in checked}
    return {**params, "engine/cpu_int8": cpu_int8_isa()}


def is_mlflow(logger: Any) -> bool:
    """Whether ``logger`` is Lightning's MLflow logger: run-level calls (status, tags, artifacts) apply to it only."""
    from lightning.pytorch.loggers import MLFlowLogger

    return isinstance(logger, MLFlowLogger)


def log_run_start(logger: Any, cfg: DictConfig, warm: Any = None, engine: Any = None) -> None:
    """A new run's record: the composed config, the option picked in each group and what the rollout engine runs
    on this host (``engine``: its :class:`~ais_lightning.rollout.EngineSpec`, :func:`engine_params`) as params, and
    the warm start's accuracy and steps at step 0 (``warm``: a ``WarmStartResult``; the start the run's gains are
    measured from)."""
    logger.log_hyperparams({**flatten_config(cfg), **option_choices(), **engine_params(engine)})
    if warm is not None:
        logger.log_metrics({"warmstart/accuracy": warm.accuracy, "warmstart/steps": warm.steps}, step=0)


def reopen_run(logger: Any) -> None:
    """Mark ``logger``'s MLflow run RUNNING again after a Lightning stage finalized it.

    Lightning finalizes every logger ("success" -> FINISHED) at the end of *each* stage, so a
    ``trainer.validate`` before ``trainer.fit`` leaves the run FINISHED during training: a sweep
    report would average it as done and a killed run would look complete. ``fit`` finalizes it
    again (FINISHED, or FAILED on an exception). No-op for other loggers.
    """
    if is_mlflow(logger):
        logger.experiment.update_run(logger.run_id, status="RUNNING")
