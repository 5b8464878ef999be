"""Build a run's components from a composed config, validating everything before anything heavy starts.

:func:`validate` instantiates every cheap component once (task, corrector, loss, the settings of each
group, the policy spec) with ``hydra.utils.instantiate``, asks the engine class to check its arguments
(no model is built), applies the rules that involve several groups, and returns the built
:class:`Components`. Every error is a ``ValueError`` that names the config key::

    corrector.c_high must be >= 1 (ratio 1 = on-policy must stay in range), got 0.5 [corrector: ...TIS]
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, read_write

from ais_lightning.correctors import NoCorrection

log = logging.getLogger(__name__)

GROUPS = ("policy", "rollout", "loss", "algorithm", "corrector", "task", "warmstart", "trainer", "logger")
"""The config groups of ``ais-train``, in the order they are built (``algorithm`` before ``corrector``, which
reads its beta1: a bad ``algorithm.betas`` is then reported under its own name)."""


@dataclass
class Components:
    """Everything a run needs, built and validated; only the policy and the engines remain to build."""

    policy: Any
    """The policy spec: ``policy.build(seed)`` makes the ``Policy`` (e.g. ``ais_lightning.policy.TinyQwen3``)."""
    engine: Callable[..., Any]
    """``engine(model)`` builds the rollout engine (a ``functools.partial`` of the engine class)."""
    eval_engine: Callable[..., Any] | None
    """The same engine at the trainer's precision (fp32), for validation accuracy; None if not available."""
    loss: Any
    corrector: Any
    task: Any
    algorithm: Any
    warmstart: Any
    trainer: Any
    logger: Any

    def initial_policy(self, seed: int, warm: bool = True, progress_bar: bool = False) -> tuple[Any, Any]:
        """The policy a run starts from, and its warm start (``WarmStartResult``; None when off or ``warm=False``).

        With a warm start the initial weights are the warm start's (they are in its cache key): every RL seed
        of a sweep then shares one warm start, built from ``warmstart.seed`` (else ``seed``). Raises
        ``ais_lightning.warmstart.WarmStartError`` when the warm start misses its band.
        """
        enabled = self.warmstart.enabled
        init_seed = self.warmstart.seed if enabled and self.warmstart.seed is not None else seed
        policy = self.policy.build(init_seed)
        self.check_engines_on(policy.model)
        if not (warm and enabled):
            return policy, None
        from ais_lightning.warmstart import warm_start

        result = warm_start(
            policy, policy.tokenizer, self.task, self.warmstart, seed=seed, progress_bar=progress_bar
        )
        return policy, result

    def check_engines_on(self, model: Any) -> None:
        """The engines' checks that need the model itself (an engine class's ``check_model``, e.g. a
        quantized precision on weights the torch engine cannot quantize), before any warm start or training."""
        for factory in (self.engine, self.eval_engine):
            check = getattr(getattr(factory, "func", None), "check_model", None)
            if check is not None:
                try:
                    check(model, **(factory.keywords or {}))
                except ValueError as err:
                    raise ValueError(
                        f"rollout ({factory.func.__name__} on the policy's model): {err}"
                    ) from err

    def grpo_module(
        self, policy: Any, seed: int, module_class: type | None = None, validation: bool = True
    ) -> Any:
        """The run's LightningModule on ``policy``: ``module_class``, else the algorithm's own
        (``algorithm.module_class``, e.g. Sol-RL's), else ``GRPOModule``. ``validation=False`` leaves out
        the trainer-precision engine that validation uses."""
        from ais_lightning.modules.grpo import GRPOModule

        if module_class is None:  # an algorithm's module_class returns its class (imported lazily)
            factory = getattr(self.algorithm, "module_class", None)
            module_class = factory() if factory is not None else GRPOModule
        return module_class(
            policy=policy,
            task=self.task,
            corrector=self.corrector,
            loss=self.loss,
            engine_factory=self.engine,
            settings=self.algorithm,
            eval_engine_factory=self.eval_engine if validation else None,
            seed=seed,
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
    from torch import nn

    from ais_lightning.correctors import Corrector
    from ais_lightning.modules.grpo import GRPOSettings
    from ais_lightning.tasks import Task
    from ais_lightning.tracking import LoggerSettings
    from ais_lightning.trainer import TrainerSettings
    from ais_lightning.warmstart import WarmStartSettings

    def subclass(base: type) -> Callable[[type], bool]:
        return lambda cls: issubclass(cls, base)

    return {
        "policy": (
            "a policy spec, whose build(seed) makes the Policy (e.g. ais_lightning.policy.TinyQwen3)",
            lambda cls: callable(getattr(cls, "build", None)),
        ),
        "loss": ("a policy loss, an nn.Module (e.g. ais_lightning.losses.GRPOLoss)", subclass(nn.Module)),
        "corrector": ("a Corrector (e.g. ais_lightning.correctors.TIS)", subclass(Corrector)),
        "task": ("a Task (e.g. ais_lightning.tasks.arithmetic.Arithmetic)", subclass(Task)),
        "algorithm": (
            "GRPOSettings or a subclass (ais_lightning.modules.grpo.GRPOSettings)",
            subclass(GRPOSettings),
        ),
        "warmstart": (
            "WarmStartSettings (ais_lightning.warmstart.WarmStartSettings)",
            subclass(WarmStartSettings),
        ),
        "trainer": ("TrainerSettings (ais_lightning.trainer.TrainerSettings)", subclass(TrainerSettings)),
        "logger": ("LoggerSettings (ais_lightning.tracking.LoggerSettings)", subclass(LoggerSettings)),
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


def check_engine(cfg: DictConfig) -> tuple[type, dict[str, Any]]:
    """The engine class of ``cfg.rollout`` and its arguments, checked (and completed with the
    constructor's defaults by its ``check_args``, if it has one) without building a model."""
    node = cfg.rollout
    try:
        engine_cls = get_object(node._target_)
    except Exception as err:
        raise ValueError(f"rollout._target_={node._target_!r} cannot be imported: {err}") from err
    built = _built_class(engine_cls)
    if built is None or not all(callable(getattr(built, m, None)) for m in ("generate", "sync_weights")):
        raise ValueError(
            f"rollout._target_={node._target_} does not build a rollout engine: the rollout group names what builds "
            "the engine from the policy's model, a class with generate() and sync_weights() (e.g. "
            "ais_lightning.rollout.TorchRolloutEngine) or a function annotated to return one"
        )
    args = _arguments(node)
    check = getattr(engine_cls, "check_args", None)
    if check is not None:
        try:
            args = {**args, **(check(**args) or {})}
        except (TypeError, ValueError) as err:
            raise ValueError(_explain("rollout", node, err)) from err
    return engine_cls, args


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


def _check_combination(c: Components, cfg: DictConfig, engine_cls: type, engine_args: dict[str, Any]) -> None:
    """The rules that involve several groups."""
    policy_family = getattr(c.policy, "MODEL_FAMILY", "autoregressive")
    engine_family = getattr(engine_cls, "MODEL_FAMILY", "autoregressive")
    if policy_family != engine_family:
        raise ValueError(
            f"rollout._target_={cfg.rollout._target_} samples {engine_family} models but the policy "
            f"({cfg.policy._target_}) is {policy_family}: pick a rollout option of the policy's family"
        )
    length = getattr(c.policy, "response_length", None)
    if length is not None and length != c.algorithm.max_new_tokens:
        raise ValueError(
            f"policy.response_length={length} must equal algorithm.max_new_tokens={c.algorithm.max_new_tokens} "
            "(a masked-diffusion policy is warm-started on the canvas length its engine samples)"
        )
    if length is not None and c.warmstart.enabled and c.warmstart.max_new_tokens != length:
        raise ValueError(
            f"warmstart.max_new_tokens={c.warmstart.max_new_tokens} must equal policy.response_length={length} "
            "(the warm start's greedy evaluation samples a canvas of that length)"
        )
    if getattr(c.policy, "router_replay", False) and not getattr(engine_cls, "RECORDS_ROUTING", False):
        raise ValueError(
            f"policy.router_replay=true replays the routing the rollout engine records, but rollout._target_="
            f"{cfg.rollout._target_} records none: use the torch engine (rollout=fp32/bf16/int8/fp8/fp4, ...) or "
            "policy.router_replay=false"
        )
    own = getattr(c.loss, "own_correction", None)
    if own and not isinstance(c.corrector, NoCorrection):
        raise ValueError(
            f"{own}; it takes no separate importance weights: set corrector=none "
            f"(got corrector._target_={cfg.corrector._target_})"
        )
    corrected = own or not isinstance(c.corrector, NoCorrection)
    if corrected and (c.algorithm.top_p < 1.0 or c.algorithm.top_k > 0):
        raise ValueError(
            "algorithm.top_p/top_k renormalize mu over the kept tokens; with a corrector on keep top_p=1.0 "
            "and top_k=0"
        )
    if c.trainer.on_gpu() and engine_args.get("backend") == "int8" and engine_args.get("device") != "cpu":
        raise ValueError(
            "rollout.backend=int8 (the integer W8A8 GEMM) runs on CPU; with a GPU trainer pick rollout.backend="
            "emulate, rollout=bf16/fp8_gemm/te_fp8/vllm_fp8, or keep the int8 engine on the CPU with rollout.device=cpu"
        )
    check = getattr(c.algorithm, "check_components", None)  # an algorithm's own cross-group rules
    if check is not None:
        check(c, cfg)
    aligned = getattr(c.policy, "aligned_quantization", None)
    if aligned is not None and c.trainer.strategy != "auto":
        raise ValueError(
            "policy.aligned_quantization is not supported with sharded strategies yet (trainer.strategy)"
        )
    _check_float16(c)
    _check_head_precision(c, cfg, engine_cls, engine_args)


FP16_TRAINER_PRECISIONS = ("32-true", "32", 32)
"""``trainer.precision`` values a float16 policy trains under: the policy keeps its own fp32 master weights and loss
scale (``ais_lightning.modules.mixed_precision``), so Lightning's precision plugin must not cast or scale again."""


def _check_float16(c: Components) -> None:
    """``policy.dtype=float16`` trains on fp32 master weights with a loss scale of its own: on one process or DDP
    (``trainer.strategy=auto``) under Lightning's plain fp32 plugin."""
    if getattr(c.policy, "dtype", None) != "float16":
        return
    if c.trainer.strategy != "auto":
        raise ValueError(
            f"policy.dtype=float16 (fp32 master weights and a dynamic loss scale) is not supported with "
            f"trainer.strategy={c.trainer.strategy} yet: use trainer.strategy=auto, or policy.dtype=bfloat16"
        )
    if c.trainer.precision not in FP16_TRAINER_PRECISIONS:
        raise ValueError(
            f"policy.dtype=float16 keeps its own fp32 master weights and loss scale; trainer.precision="
            f"{c.trainer.precision} would cast or scale again: leave trainer.precision=32-true"
        )


def _check_head_precision(
    c: Components, cfg: DictConfig, engine_cls: type, engine_args: dict[str, Any]
) -> None:
    """With a bfloat16/float16 policy, warn (naming both keys) when the LM head computes in fp32 on one side only.

    Both sides compute the head from the same low-precision weights; in the model dtype both round the logits to
    the same grid, so where the hidden states agree the rounding cancels in log pi - log mu, and an fp32 head on one
    side leaves the other side's rounding in the mismatch. NeMo-RL refuses that configuration
    (``validate_fp32_lm_head_config``: "a one-sided fp32 head increases the generation/training logprob mismatch").
    Measured here (docs/correctors.md, docs/real_model.md): where trainer and engine compute bit-identical hidden
    states (the built-in model through the model's own forward) one side only is worse than neither (3e-6 of KL
    against 0); on SmolLM2, whose engine's hidden states differ by their own rounding, it lands between neither and
    both (bf16: 1.4-1.7e-3 against 1.9-2.2e-3 and 0.9-1.1e-3). Both sides is the best in every measurement, one side
    is not always worse than neither, so this warns rather than refuses. With a float32 policy the trainer's head is
    fp32 anyway and ``rollout.head_dtype=float32`` only brings a bf16/fp16 or quantized engine closer to it.
    """
    dtype = getattr(c.policy, "dtype", "float32")
    if dtype == "float32":
        return
    policy_head = getattr(c.policy, "head_dtype", None)
    engine_head = engine_args.get("head_dtype")
    policy_fp32, engine_fp32 = policy_head == "float32", engine_head == "float32"
    if policy_fp32 == engine_fp32:
        return
    on, off = ("policy", "rollout") if policy_fp32 else ("rollout", "policy")
    fix = f"set {off}.head_dtype=float32 as well"
    if "head_dtype" not in engine_args:
        fix = (
            f"rollout._target_={cfg.rollout._target_} has no rollout.head_dtype option (its head computes in the "
            "model dtype): use the torch engine with rollout.head_dtype=float32"
        )
    log.warning(
        "policy.head_dtype=%s and rollout.head_dtype=%s with policy.dtype=%s: the LM head computes in fp32 on the %s "
        "side only. Both sides in fp32 gave the smallest train/rollout mismatch in every measurement "
        "(docs/correctors.md); one side only leaves the other side's rounding of the logits in the mismatch (worse "
        "than neither where both sides compute the same hidden states; NeMo-RL refuses it). To fix: %s, or unset "
        "%s.head_dtype",
        policy_head, engine_head, dtype, on, fix, on,
    )  # fmt: skip


def _settle_task(task: Any, cfg: DictConfig) -> None:
    """Settle what follows the task before the other groups are built (they interpolate it):

    - ``task.format=auto`` follows the policy: ``chat`` when it prompts through its chat template
      (``policy.chat_template=true``), else ``bare``; an explicit ``bare`` or ``chat`` is kept.
    - ``algorithm.max_new_tokens`` left null is the task's response budget in that format
      (:meth:`ais_lightning.tasks.Task.response_budget`).

    Both are written back to ``cfg``, so the config a run logs names them."""
    resolve = getattr(task, "resolve_format", None)
    if resolve is not None:  # else a task of one format (no format option)
        settled = resolve(bool(cfg.policy.get("chat_template", False)))
        if cfg.task.get("format") == "auto" and not OmegaConf.is_readonly(cfg):
            cfg.task.format = settled
    if "algorithm" in cfg and cfg.algorithm.get("max_new_tokens", 0) is None:
        budget = getattr(task, "response_budget", None)
        if budget is None:
            raise ValueError(
                f"algorithm.max_new_tokens is null but the task ({cfg.task._target_}) has no response_budget(): "
                "set algorithm.max_new_tokens"
            )
        with read_write(cfg):
            cfg.algorithm.max_new_tokens = budget()


def _resolve_warm_start(c: Components, cfg: DictConfig) -> None:
    """``warmstart.enabled=auto`` follows the policy: on for one that starts from random weights (the built-in
    models), off for a pretrained checkpoint (a policy spec's ``PRETRAINED_WEIGHTS``; a user's spec without it
    counts as random). The settled value is written back to ``cfg.warmstart.enabled``, so the logged config
    names it."""
    from ais_lightning.warmstart import resolve_enabled

    pretrained = bool(getattr(c.policy, "PRETRAINED_WEIGHTS", False))
    c.warmstart.enabled = resolve_enabled(c.warmstart.enabled, starts_pretrained=pretrained)
    if cfg.warmstart.get("enabled") == "auto" and not OmegaConf.is_readonly(cfg):
        cfg.warmstart.enabled = c.warmstart.enabled


def _align_outlier_channels(policy: Any, engine_args: dict[str, Any]) -> None:
    """With ``policy.aligned_quantization`` the trainer runs the rollout recipe on every input channel, so the
    engine keeps no outlier channel in high precision: ``rollout.outlier_fraction`` left None becomes 0; a
    positive value is refused (the two forwards would differ on purpose)."""
    if getattr(policy, "aligned_quantization", None) is None or "outlier_fraction" not in engine_args:
        return
    fraction = engine_args["outlier_fraction"]
    if fraction is None:
        engine_args["outlier_fraction"] = 0.0
    elif fraction > 0:
        raise ValueError(
            f"rollout.outlier_fraction={fraction} keeps outlier channels in high precision in the engine, but "
            "policy.aligned_quantization runs the trainer's forward through the recipe on every channel: set "
            "rollout.outlier_fraction=0 (or leave it unset) for the aligned forward to match the engine"
        )


def validate(cfg: DictConfig) -> Components:
    """Build and check every cheap component of a composed ``ais-train`` config; raises ValueError naming the key.

    Types and unknown keys were already checked at composition by the schemas; this builds the objects
    (whose constructors check their own arguments) and adds the rules that involve several groups
    (``task.format=auto`` and ``algorithm.max_new_tokens=null`` are settled here from ``policy.chat_template``
    and the task, ``warmstart.enabled=auto`` from the policy option, in the components and in ``cfg``).
    Nothing heavy is built: no model, no engine.
    """
    check_trusted_targets(cfg)  # before any _target_ is imported or called
    _check_missing(cfg, ("task",))
    task = build_option(cfg, "task")
    _settle_task(task, cfg)  # before the rest: other groups interpolate algorithm.max_new_tokens
    _check_missing(cfg)
    engine_cls, checked_args = check_engine(cfg)
    # the algorithm first: other groups interpolate its values, and a bad one is reported under its own key
    order = ("algorithm", *(g for g in GROUPS if g not in ("algorithm", "rollout", "task")))
    built = {g: build_option(cfg, g) for g in order}
    engine_args = _arguments(cfg.rollout)
    _align_outlier_channels(built["policy"], engine_args)
    eval_engine = None
    copy_args = getattr(engine_cls, "TRAINER_PRECISION_COPY", None)
    if copy_args is not None:
        copy_args = dict(copy_args)
        if "head_dtype" in checked_args:  # the trainer-precision copy computes its head as the trainer does
            copy_args["head_dtype"] = getattr(built["policy"], "head_dtype", None)
        eval_engine = functools.partial(engine_cls, **{**engine_args, **copy_args})
    components = Components(
        engine=functools.partial(engine_cls, **engine_args), eval_engine=eval_engine, task=task, **built
    )
    _resolve_warm_start(components, cfg)
    _check_combination(components, cfg, engine_cls, checked_args)
    return components
