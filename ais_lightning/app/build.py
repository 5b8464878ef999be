"""Build a run's components from a composed config, validating everything before anything heavy starts.

:func:`validate` instantiates every cheap component once (task, corrector, loss, the settings of each
group, the policy spec) with ``hydra.utils.instantiate``, makes the engine's
:class:`~ais_lightning.rollout.EngineSpec` (its class checks its arguments once; no model is built), applies the
rules that involve several groups (:mod:`ais_lightning.app.rules`), and returns the built :class:`Components`. Every
error is a ``ValueError`` that names the config key::

    corrector.c_high must be >= 1 (ratio 1 = on-policy must stay in range), got 0.5 [corrector: ...TIS]
"""

from __future__ import annotations

import inspect
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, read_write

from ais_lightning.app import rules
from ais_lightning.rollout.factory import EngineSpec

GROUPS = ("policy", "rollout", "loss", "algorithm", "corrector", "task", "warmstart", "trainer", "logger")
"""The config groups of ``ais-train``, in the order they are built (``algorithm`` before ``corrector``, which
reads its beta1: a bad ``algorithm.betas`` is then reported under its own name)."""


@dataclass
class Components:
    """Everything a run needs, built and validated; only the policy and the engines remain to build."""

    policy: Any
    """The policy spec (an ``ais_lightning.policy.PolicySpec``): ``policy.build(seed)`` makes the ``Policy``."""
    engine: EngineSpec
    """``engine(model)`` builds the rollout engine (the engine class and its checked arguments)."""
    eval_engine: EngineSpec | None
    """The same engine at the trainer's precision (fp32), for validation accuracy; None if not available (the
    engine class's ``TRAINER_PRECISION_COPY`` is None)."""
    loss: Any
    corrector: Any
    task: Any
    algorithm: Any
    warmstart: Any
    trainer: Any
    logger: Any
    workers: Any = None
    """Rollout workers (``workers=ray``: ``ais_lightning.rollout.ray_workers.RayWorkers``); None: the in-process
    engine."""

    def initial_policy(self, seed: int, warm: bool = True, progress_bar: bool = False) -> tuple[Any, Any]:
        """The policy a run starts from, and its warm start (``WarmStartResult``; None when off or ``warm=False``).
        The task's text is fitted to the policy's tokenizer first (``Task.fit_text``).

        With a warm start the initial weights are the warm start's (they are in its cache key): every RL seed
        of a sweep then shares one warm start, built from ``warmstart.seed`` (else ``seed``). Raises
        ``ais_lightning.app.warmstart.WarmStartError`` when the warm start misses its band.
        """
        enabled = self.warmstart.enabled
        init_seed = self.warmstart.seed if enabled and self.warmstart.seed is not None else seed
        policy = self.policy.build(init_seed)
        self.check_engines_on(policy.model)
        if policy.tokenizer is not None:  # text the tokenizer cannot encode: mapped, saying so, or refused
            from ais_lightning.tasks.base import tokenizer_keeps

            self.task.fit_text(tokenizer_keeps(policy.tokenizer))
        if not (warm and enabled):
            return policy, None
        from ais_lightning.app.warmstart import warm_start

        result = warm_start(
            policy, policy.tokenizer, self.task, self.warmstart, seed=seed, progress_bar=progress_bar
        )
        return policy, result

    def check_engines_on(self, model: Any) -> None:
        """The engines' checks that need the model itself (an engine class's ``check_model``, e.g. a
        quantized precision on weights the torch engine cannot quantize), before any warm start or training; once
        per distinct engine."""
        specs = [self.engine]
        if self.eval_engine is not None and not self.eval_engine.same_engine_as(self.engine):
            specs.append(self.eval_engine)
        for spec in specs:
            try:
                spec.engine_class.check_model(model, **spec.keywords)
            except ValueError as err:
                raise ValueError(
                    f"rollout ({spec.engine_class.__name__} on the policy's model): {err}"
                ) from err

    def grpo_module(
        self, policy: Any, seed: int, module_class: type | None = None, validation: bool = True
    ) -> Any:
        """The run's LightningModule on ``policy``: ``module_class``, else the algorithm's own
        (``algorithm.module_class``, e.g. Sol-RL's), else ``GRPOModule``. ``validation=False`` leaves out
        the trainer-precision engine that validation uses."""
        if module_class is None:  # GRPOModule, or the algorithm's own subclass (Sol-RL's)
            module_class = self.algorithm.module_class()
        return module_class(
            policy=policy,
            task=self.task,
            corrector=self.corrector,
            loss=self.loss,
            engine_factory=self.engine,
            settings=self.algorithm,
            eval_engine_factory=self.eval_engine if validation else None,
            seed=seed,
            workers=self.workers,
        )

    def prompt_data(self, batches: int, seed: int) -> Any:
        """The prompts ``ais-train`` draws: an endless stream cut into ``batches`` batches per epoch (batch k
        is the same whatever ``batches`` is), with ``algorithm.val_size`` held-out validation prompts."""
        from ais_lightning.tasks import PromptDataModule

        return PromptDataModule(
            self.task,
            train_size=None,
            batches_per_epoch=batches,
            val_size=self.algorithm.val_size,
            batch_size=self.algorithm.prompts_per_step,
            val_batch_size=self.algorithm.val_batch_size,
            seed=seed,
        )


def _arguments(node: DictConfig) -> dict[str, Any]:
    return {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not k.startswith("_")}


def _explain(group: str, node: DictConfig, err: BaseException) -> str:
    """A message naming the key: ``<group>.<argument> ...`` when the error names an argument."""
    target = node.get("_target_", "?")
    text = str(err)
    match = re.search(r"unexpected keyword argument '(\w+)'", text)
    if isinstance(err, TypeError) and match:
        return f"{group}.{match.group(1)} is not an argument of {target}"
    match = re.search(r"missing \d+ required (?:positional|keyword-only) arguments?: '(\w+)'", text)
    if isinstance(err, TypeError) and match:
        return f"{group}.{match.group(1)} is required by {target}"
    first = re.match(r"(?:[A-Z]\w*\.)?([A-Za-z_]\w*)", text)  # "c_high must ..." or "Settings.steps must ..."
    if first and first.group(1) in node:
        return f"{group}.{first.group(1)}{text[first.end() :]} [{group}: {target}]"
    return f"{group}: {text} [{group}: {target}]"


def _component_kinds() -> dict[str, tuple[str, Callable[[type], bool]]]:
    """Per group, what its ``_target_`` must build: a description (with an example) and a test of the built
    object's class."""
    from ais_lightning.app.tracking import LoggerSettings
    from ais_lightning.app.trainer import TrainerSettings
    from ais_lightning.app.warmstart import WarmStartSettings
    from ais_lightning.correctors import Corrector
    from ais_lightning.losses import PolicyLoss
    from ais_lightning.modules.grpo import GRPOSettings
    from ais_lightning.policy import PolicySpec
    from ais_lightning.rollout.ray_workers import RayWorkers
    from ais_lightning.tasks import Task

    def subclass(base: type) -> Callable[[type], bool]:
        return lambda cls: issubclass(cls, base)

    return {
        "policy": (
            "a policy spec, a PolicySpec whose build(seed) makes the Policy (e.g. ais_lightning.policy.TinyQwen3)",
            subclass(PolicySpec),
        ),
        "loss": ("a policy loss, a PolicyLoss (e.g. ais_lightning.losses.GRPOLoss)", subclass(PolicyLoss)),
        "corrector": ("a Corrector (e.g. ais_lightning.correctors.TIS)", subclass(Corrector)),
        "task": ("a Task (e.g. ais_lightning.tasks.arithmetic.Arithmetic)", subclass(Task)),
        "algorithm": (
            "GRPOSettings or a subclass (ais_lightning.modules.grpo.GRPOSettings)",
            subclass(GRPOSettings),
        ),
        "warmstart": (
            "WarmStartSettings (ais_lightning.app.warmstart.WarmStartSettings)",
            subclass(WarmStartSettings),
        ),
        "trainer": ("TrainerSettings (ais_lightning.app.trainer.TrainerSettings)", subclass(TrainerSettings)),
        "logger": ("LoggerSettings (ais_lightning.app.tracking.LoggerSettings)", subclass(LoggerSettings)),
        "workers": ("RayWorkers (ais_lightning.rollout.ray_workers.RayWorkers)", subclass(RayWorkers)),
    }


def _built_class(target: Any) -> type | None:
    """The class of what calling ``target`` builds, known without calling it: ``target`` itself for a class, a
    function's return annotation; None when it cannot be told (a function without one, ``os.abort``)."""
    if inspect.isclass(target):
        return target
    try:
        returned = typing.get_type_hints(target).get("return")
    except Exception:  # no annotations to read (a builtin), or unresolvable ones
        return None
    return returned if inspect.isclass(returned) else None


def _check_target_kind(group: str, node: DictConfig) -> None:
    """Refuse, before anything is called, a ``_target_`` that cannot build what ``group`` needs (e.g.
    ``corrector._target_=os.getcwd``, which builds a string, or ``os.abort``, which would end the process)."""
    kinds = _component_kinds()
    if group not in kinds:
        return
    what, test = kinds[group]
    try:
        target = get_object(node._target_)
    except Exception as err:
        raise ValueError(f"{group}._target_={node._target_!r} cannot be imported: {err}") from err
    cls = _built_class(target)
    if cls is None:
        raise ValueError(
            f"{group}._target_={node._target_} is a {type(target).__name__} whose result cannot be known before it "
            f"runs; {group} must build {what}: name a class, or a function annotated to return one"
        )
    if not test(cls):
        raise ValueError(f"{group}._target_={node._target_} builds a {cls.__name__}, not {what}")


def build_option(cfg: DictConfig, group: str, **runtime: Any) -> Any:
    """``instantiate(cfg[group], **runtime)`` with errors re-raised as ValueError naming the config key.

    The ``_target_`` of a component group is checked before it is called (a class of the group's kind, or a
    function annotated to return one), and the object built is checked again (``corrector`` is a
    ``Corrector``, ``task`` a ``Task``, ...): a wrong one is named here, not deep inside training."""
    node = cfg[group]
    if "_target_" not in node:
        raise ValueError(f"{group} has no _target_: pick an option ({group}=...) or give {group}._target_")
    _check_target_kind(group, node)
    try:
        built = instantiate(node, **runtime)
    except InstantiationException as err:
        cause = err.__cause__
        if cause is None or "Error locating target" in str(err):
            raise ValueError(
                f"{group}._target_={node._target_!r} cannot be imported: {cause or err}"
            ) from err
        raise ValueError(_explain(group, node, cause)) from cause
    kind = _component_kinds().get(group)
    if kind is not None and not kind[1](type(built)):  # e.g. a function that returned something else
        raise ValueError(f"{group}._target_={node._target_} built a {type(built).__name__}, not {kind[0]}")
    return built


def check_engine(cfg: DictConfig) -> EngineSpec:
    """The engine of ``cfg.rollout``: its class (a ``RolloutEngine`` subclass) with the config's arguments, checked by
    the class's ``check_args`` (once) without building a model. With an aligned trainer forward an unset
    ``rollout.outlier_fraction`` is 0 (:func:`ais_lightning.app.rules.align_outlier_channels`)."""
    from ais_lightning.rollout import RolloutEngine

    node = cfg.rollout
    try:
        engine_cls = get_object(node._target_)
    except Exception as err:
        raise ValueError(f"rollout._target_={node._target_!r} cannot be imported: {err}") from err
    if not (inspect.isclass(engine_cls) and issubclass(engine_cls, RolloutEngine)):
        raise ValueError(
            f"rollout._target_={node._target_} does not build a rollout engine: the rollout group names the engine "
            "class, built later from the policy's model: a subclass of ais_lightning.rollout.RolloutEngine (e.g. "
            "ais_lightning.rollout.TorchRolloutEngine)"
        )
    args = _arguments(node)
    rules.align_outlier_channels(cfg, args)
    try:
        return EngineSpec(engine_cls, **args)
    except (TypeError, ValueError) as err:
        raise ValueError(_explain("rollout", node, err)) from err


def trainer_precision_engine(engine: EngineSpec, policy: Any) -> EngineSpec | None:
    """The run's engine at the trainer's precision (its class's ``TRAINER_PRECISION_COPY`` over its arguments,
    the LM head computed as the policy's), for validation accuracy; None when the class has no such copy."""
    copy_args = engine.engine_class.TRAINER_PRECISION_COPY
    if copy_args is None:
        return None
    copy_args = dict(copy_args)
    if (
        "head_dtype" in engine.checked_arguments
    ):  # the trainer-precision copy computes its head as the trainer does
        copy_args["head_dtype"] = policy.head_dtype
    try:
        return EngineSpec(engine.engine_class, **{**engine.keywords, **copy_args})
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"rollout: the trainer-precision copy of {engine.engine_class.__name__} (its TRAINER_PRECISION_COPY "
            f"{copy_args}) is refused: {err}"
        ) from err


TRUSTED_TARGETS_ENV = "AIS_LIGHTNING_TRUSTED_TARGETS"
"""Environment variable: comma-separated modules a config's ``_target_`` may name besides ``ais_lightning``;
it applies on top of the ``trusted_targets`` key (a config cannot loosen it)."""


def _targets(node: Any, path: str) -> Any:
    """``(key, value)`` of every ``_target_`` in a config subtree, depth first."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            child_path = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                try:
                    value = node[key]
                except Exception as err:  # an interpolation that does not resolve
                    raise ValueError(f"{child_path} cannot be resolved: {err}") from err
                yield child_path, value
            else:
                yield from _targets(node._get_node(key), child_path)
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _targets(node._get_node(i), f"{path}[{i}]")


def check_trusted_targets(cfg: DictConfig) -> None:
    """Refuse a config whose ``_target_`` (anywhere in it) is outside ``ais_lightning`` and the trusted modules.

    A config is code: instantiating it calls whatever its ``_target_`` keys name. ``trusted_targets`` (a list of
    modules, e.g. ``[my_pkg]``; null = no restriction, the default) and ``$AIS_LIGHTNING_TRUSTED_TARGETS``
    (comma-separated) restrict them to this package plus those modules and their submodules (or exact dotted
    names); when both are given a target must pass both. Checked before anything is imported or called.
    Hydra's own keys (``hydra.*``: launcher, sweeper, callbacks) are Hydra's to instantiate, before any run.
    """
    restrictions = []
    configured = cfg.get("trusted_targets") if isinstance(cfg, DictConfig) else None
    if configured is not None:
        restrictions.append(("trusted_targets", [str(m) for m in configured]))
    if os.environ.get(TRUSTED_TARGETS_ENV, "").strip():
        modules = [m.strip() for m in os.environ[TRUSTED_TARGETS_ENV].split(",") if m.strip()]
        restrictions.append((f"${TRUSTED_TARGETS_ENV}", modules))
    if not restrictions:
        return
    for key, target in _targets(cfg, ""):
        for source, modules in restrictions:
            allowed = ["ais_lightning", *modules]
            if not isinstance(target, str) or not any(
                target == m or target.startswith(f"{m}.") for m in allowed
            ):
                raise ValueError(
                    f"{key}={target} is not trusted: {source} allows targets in {', '.join(allowed)} only (a config "
                    f"is code; add the module to {source} if you trust it)"
                )


def _check_missing(cfg: DictConfig, groups: tuple[str, ...] = GROUPS) -> None:
    missing = [
        key if key.startswith(f"{group}.") else f"{group}.{key}"  # OmegaConf 2.3 gives a child's full keys
        for group in groups
        if isinstance(cfg.get(group), DictConfig)
        for key in sorted(OmegaConf.missing_keys(cfg[group]))
    ]
    if missing:
        raise ValueError(
            f"{missing[0]} is required (its value is ??? in the config); set it on the command line, "
            f"e.g. {missing[0]}=..."
        )


def _settle_task(task: Any, cfg: DictConfig) -> None:
    """Settle what follows the task before the other groups are built (they interpolate it):

    - ``task.format=auto`` follows the policy: ``chat`` when it prompts through its chat template
      (``policy.chat_template=true``), else ``bare``; an explicit ``bare`` or ``chat`` is kept.
    - ``algorithm.max_new_tokens`` left null is the task's response budget in that format
      (:meth:`ais_lightning.tasks.Task.response_budget`).

    Both are written back to ``cfg``, so the config a run logs names them."""
    settled = task.resolve_format(bool(cfg.policy.get("chat_template", False)))
    if cfg.task.get("format") == "auto" and not OmegaConf.is_readonly(cfg):
        cfg.task.format = settled
    if "algorithm" in cfg and cfg.algorithm.get("max_new_tokens", 0) is None:
        with read_write(cfg):
            cfg.algorithm.max_new_tokens = task.response_budget()


def _resolve_warm_start(components: Components, cfg: DictConfig) -> None:
    """``warmstart.enabled=auto`` follows the policy: on for one that starts from random weights (the built-in
    models), off for a pretrained checkpoint (a policy spec's ``PRETRAINED_WEIGHTS``; a user's spec without it
    counts as random). The settled value is written back to ``cfg.warmstart.enabled``, so the logged config
    names it."""
    from ais_lightning.app.warmstart import resolve_enabled

    pretrained = bool(components.policy.PRETRAINED_WEIGHTS)
    components.warmstart.enabled = resolve_enabled(components.warmstart.enabled, starts_pretrained=pretrained)
    if cfg.warmstart.get("enabled") == "auto" and not OmegaConf.is_readonly(cfg):
        cfg.warmstart.enabled = components.warmstart.enabled


def validate(cfg: DictConfig) -> Components:
    """Build and check every cheap component of a composed ``ais-train`` config; raises ValueError naming the key.

    Types and unknown keys were already checked at composition by the schemas; this builds the objects
    (whose constructors check their own arguments), the engine specs (whose classes check their arguments), and
    applies the rules that involve several groups once (:func:`ais_lightning.app.rules.check_components`;
    ``task.format=auto`` and ``algorithm.max_new_tokens=null`` are settled here from ``policy.chat_template``
    and the task, ``warmstart.enabled=auto`` from the policy option, in the components and in ``cfg``).
    Nothing heavy is built: no model, no engine.
    """
    check_trusted_targets(cfg)  # before any _target_ is imported or called
    rules.check_seeds(cfg)
    _check_missing(cfg, ("task",))
    task = build_option(cfg, "task")
    _settle_task(task, cfg)  # before the rest: other groups interpolate algorithm.max_new_tokens
    _check_missing(cfg)
    engine = check_engine(cfg)
    # the algorithm first: other groups interpolate its values, and a bad one is reported under its own key
    order = ("algorithm", *(g for g in GROUPS if g not in ("algorithm", "rollout", "task")))
    built = {g: build_option(cfg, g) for g in order}
    if cfg.get("workers") is not None:  # an optional group (null: the in-process engine)
        built["workers"] = build_option(cfg, "workers")
    eval_engine = trainer_precision_engine(engine, built["policy"])
    components = Components(engine=engine, eval_engine=eval_engine, task=task, **built)
    _resolve_warm_start(components, cfg)
    rules.check_components(components, cfg)
    return components
