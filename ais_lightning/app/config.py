"""Hydra configs: one structured schema per option, generated from the constructor it builds.

Every option of a component group (``policy``, ``rollout``, ``loss``, ``corrector``, ``task``) and of a
settings group (``algorithm``, ``warmstart``, ``trainer``, ``logger``) starts from a schema: a dataclass
whose fields are exactly the keyword arguments of its ``_target_`` (a class or a builder function),
with that callable's own defaults. :func:`schema_for` generates it from the signature, and
:func:`register_configs` stores every built-in one in Hydra's ConfigStore as ``schema/<group>/<name>``.
A YAML option then reads::

    # conf/corrector/tis_seq.yaml
    defaults:
      - /schema/corrector/tis@_here_
      - _self_
    level: sequence

so a default lives in exactly one place (the constructor), a misspelled key (``corrector.c_hihg=3``)
or a wrong type (``algorithm.group_size=abc``) fails at composition with the key named, and
``hydra.utils.instantiate`` builds the object, whose constructor validates its own arguments.

A user's own component needs no schema: a YAML file in a config directory on Hydra's search path
with a ``_target_`` and the constructor's arguments is enough (its arguments are checked when
:func:`ais_lightning.app.build.validate` builds it, before anything heavy starts).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional  # noqa: UP035 - OmegaConf reads typing.List and Dict in the schema

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

_SCALARS = (int, float, bool, str)
CONFIG_DIR = Path(__file__).parent / "conf"
"""The directory of ``ais-train``'s Hydra configs (``train.yaml`` and one folder per group), shipped in the wheel;
the repository's top-level ``conf`` links to it."""

MISSING_FIELD = dataclasses.MISSING

RUNTIME_ARGUMENTS: dict[str, tuple[str, ...]] = {"rollout": ("model",)}
"""Per group, the arguments a run supplies when it builds the object (not configurable)."""

PARTIAL_GROUPS = ("rollout",)
"""Groups whose options instantiate to a ``functools.partial`` (an engine needs the model first)."""


def target_path(target: Callable[..., Any]) -> str:
    """The dotted import path Hydra's ``_target_`` uses for ``target``."""
    return f"{target.__module__}.{target.__qualname__}"


def _field_type(annotation: Any) -> Any:
    """The nearest type OmegaConf can check: scalars, ``X | None``, lists and str-keyed dicts of them, else Any."""
    if annotation in _SCALARS or annotation is Any:
        return annotation
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and len(args) == 2:
            t = _field_type(inner[0])
            return Any if t is Any else Optional[t]  # noqa: UP045 - OmegaConf reads typing.Optional
        return Any
    if origin in (list, tuple, typing.List, typing.Sequence) and args:  # noqa: UP006
        item = _field_type(args[0])
        return typing.List[item if item in _SCALARS else Any]  # noqa: UP006
    if origin in (dict, typing.Dict, typing.Mapping) and len(args) == 2 and args[0] is str:  # noqa: UP006
        value = _field_type(args[1])
        return typing.Dict[str, value if value in _SCALARS else Any]  # noqa: UP006
    return Any


def _hints(target: Callable[..., Any]) -> dict[str, Any]:
    fn = target.__init__ if inspect.isclass(target) else target
    try:
        return typing.get_type_hints(fn)
    except Exception:  # unresolvable forward references: fall back to untyped fields
        return {}


def schema_for(target: Callable[..., Any], exclude: tuple[str, ...] = (), partial: bool = False) -> type:
    """A dataclass whose fields are ``target``'s keyword arguments (minus ``exclude``), plus ``_target_``.

    Field types follow the annotations where OmegaConf can check them (scalars, ``X | None``, lists and
    ``dict[str, X]``; anything else becomes ``Any``); defaults are the signature's own (a parameter
    without a default is a mandatory ``???`` field; one whose default is not a config value, e.g. a
    ``torch.dtype``, is left out). ``partial`` adds ``_partial_: true`` (instantiate
    returns a ``functools.partial`` awaiting the ``exclude``d arguments). ``*args``/``**kwargs`` are
    not configurable and are skipped.
    """
    hints = _hints(target)
    fields: list[tuple[str, Any, Any]] = [("_target_", str, field(default=target_path(target)))]
    if partial:
        fields.append(("_partial_", bool, field(default=True)))
    params = inspect.signature(target).parameters
    factories = {}
    if dataclasses.is_dataclass(target):  # a dataclass field's default_factory shows as <factory>
        factories = {
            f.name: f.default_factory
            for f in dataclasses.fields(target)
            if f.default_factory is not MISSING_FIELD
        }
    for name, p in params.items():
        if name in exclude or name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kind = _field_type(hints.get(name, Any))
        default = factories[name]() if name in factories else p.default
        if default is inspect.Parameter.empty:
            fields.append((name, kind, field(default=MISSING)))
            continue
        if default is None and kind is not Any and typing.get_origin(kind) is not typing.Union:
            kind = Optional[kind]  # noqa: UP045
        if isinstance(default, tuple):
            default = list(default)
        if isinstance(default, (list, dict)):
            fields.append((name, kind, field(default_factory=lambda d=default: copy.deepcopy(d))))
        elif default is None or isinstance(default, _SCALARS):
            fields.append((name, kind, field(default=default)))
        # else: a default that is no config value (a torch.dtype...) stays the constructor's own and the
        # argument is not configurable; give such arguments string values to make them configurable.
    return dataclasses.make_dataclass(f"{target.__name__}Schema", fields)


@dataclass
class TrainConfig:
    """The whole ``ais-train`` run (``conf/train.yaml``); each group's schema comes from its option."""

    policy: Any = MISSING
    """The trainer's policy (``conf/policy``): a builder returning an ``ais_lightning.policy.Policy``."""
    rollout: Any = MISSING
    """The rollout engine (``conf/rollout``): an engine class, built later from the policy's model."""
    loss: Any = MISSING
    """The policy loss (``conf/loss``): ``GRPOLoss``, ``TBPOLoss`` or any loss with their call signature."""
    corrector: Any = MISSING
    """The importance-sampling corrector (``conf/corrector``)."""
    task: Any = MISSING
    """The RL task (``conf/task``): prompts and rewards."""
    algorithm: Any = MISSING
    """GRPO's loop settings (``conf/algorithm``, ``ais_lightning.modules.GRPOSettings``)."""
    warmstart: Any = MISSING
    """The SFT warm start (``conf/warmstart``, ``ais_lightning.app.warmstart.WarmStartSettings``)."""
    trainer: Any = MISSING
    """The Lightning Trainer (``conf/trainer``, ``ais_lightning.app.trainer.TrainerSettings``)."""
    logger: Any = MISSING
    """Experiment tracking (``conf/logger``, ``ais_lightning.app.tracking.LoggerSettings``)."""
    workers: Any = None
    """Rollout workers beside the trainer (``conf/workers``: ``ray``, ``ais_lightning.rollout.ray_workers.RayWorkers``);
    null: the rollout engine runs in the trainer's process."""
    seed: int = 0
    """Seed of everything: data, sampling, model init."""
    ckpt_path: Optional[str] = None  # noqa: UP045
    """Resume from this Lightning checkpoint ("last" = the newest in the output directory)."""
    overwrite: bool = False
    """A fresh run (no ``ckpt_path``) in an output directory that holds checkpoints deletes them and starts over;
    without it such a run is refused (``ais_lightning.app.rundir.check_fresh_start``)."""
    output_dir: str = MISSING
    """Where checkpoints, the summary and the default MLflow store go (Hydra's run directory)."""
    trusted_targets: Optional[List[str]] = None  # noqa: UP006, UP045
    """Modules a ``_target_`` may name besides ``ais_lightning`` (e.g. ``[my_pkg]``); null = any importable
    callable (a config is code). ``ais_lightning.app.build.check_trusted_targets`` checks the whole config first."""
    shortcuts: Dict[str, str] = field(default_factory=dict)  # noqa: UP006
    """What an option that sets keys of other groups set, by option (``corrector=qarl`` sets ``loss`` and
    ``policy.aligned_quantization``): informational, so that ``ais-train --cfg job`` says it."""


def builtin_options() -> dict[str, dict[str, Callable[..., Any]]]:
    """Every built-in option target by group and schema name (the registries of the packages)."""
    from ais_lightning.app.tracking import LoggerSettings
    from ais_lightning.app.trainer import TrainerSettings
    from ais_lightning.app.warmstart import WarmStartSettings
    from ais_lightning.correctors import CORRECTORS
    from ais_lightning.losses import LOSSES
    from ais_lightning.modules.grpo import GRPOSettings
    from ais_lightning.modules.solrl import SolRLSettings
    from ais_lightning.policy import POLICIES
    from ais_lightning.rollout import ENGINES
    from ais_lightning.rollout.ray_workers import RayWorkers
    from ais_lightning.tasks import TASKS

    return {
        "policy": dict(POLICIES),
        "rollout": dict(ENGINES),
        "loss": dict(LOSSES),
        "corrector": dict(CORRECTORS),
        "task": dict(TASKS),
        "algorithm": {"grpo": GRPOSettings, "solrl": SolRLSettings},
        "warmstart": {"default": WarmStartSettings},
        "trainer": {"default": TrainerSettings},
        "logger": {"default": LoggerSettings},
        "workers": {"ray": RayWorkers},
    }


def register_configs() -> None:
    """Store ``train_schema`` and every ``schema/<group>/<name>`` in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, options in builtin_options().items():
        exclude = RUNTIME_ARGUMENTS.get(group, ())
        for name, target in options.items():
            node = schema_for(target, exclude=exclude, partial=group in PARTIAL_GROUPS)
            cs.store(group=f"schema/{group}", name=name, node=node)


def compose_train_config(overrides: list[str]) -> Any:
    """The ``ais-train`` config composed with ``overrides`` (as on its command line), without running it.

    For scripts and notebooks that build the components ``ais-train`` would
    (``ais_lightning.app.build.validate(cfg)``); Hydra's run-time keys (``hydra.*``) are not available.
    """
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))
