"""Build a run's components from a composed config, validating everything before anything heavy starts.

:func:`validate` instantiates every cheap component once (task, corrector, loss, the settings of each
group, the policy spec) with ``hydra.utils.instantiate``, asks the engine class to check its arguments
(no model is built), applies the rules that involve several groups, and returns the built
:class:`Components`. Every error is a ``ValueError`` that names the config key::

    corrector.c_high must be >= 1 (ratio 1 = on-policy must stay in range), got 0.5 [corrector: ...TIS]
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from ais_lightning.correctors import NoCorrection

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


def build_option(cfg: DictConfig, group: str, **runtime: Any) -> Any:
    """``instantiate(cfg[group], **runtime)`` with errors re-raised as ValueError naming the config key."""
    node = cfg[group]
    if "_target_" not in node:
        raise ValueError(f"{group} has no _target_: pick an option ({group}=...) or give {group}._target_")
    try:
        return instantiate(node, **runtime)
    except InstantiationException as err:
        cause = err.__cause__
        if cause is None or "Error locating target" in str(err):
            raise ValueError(
                f"{group}._target_={node._target_!r} cannot be imported: {cause or err}"
            ) from err
        raise ValueError(_explain(group, node, cause)) from cause


def check_engine(cfg: DictConfig) -> tuple[type, dict[str, Any]]:
    """The engine class of ``cfg.rollout`` and its arguments, checked (and completed with the
    constructor's defaults by its ``check_args``, if it has one) without building a model."""
    node = cfg.rollout
    try:
        engine_cls = get_object(node._target_)
    except Exception as err:
        raise ValueError(f"rollout._target_={node._target_!r} cannot be imported: {err}") from err
    args = _arguments(node)
    check = getattr(engine_cls, "check_args", None)
    if check is not None:
        try:
            args = {**args, **(check(**args) or {})}
        except (TypeError, ValueError) as err:
            raise ValueError(_explain("rollout", node, err)) from err
    return engine_cls, args


def _check_missing(cfg: DictConfig) -> None:
    missing = [
        key if key.startswith(f"{group}.") else f"{group}.{key}"  # OmegaConf 2.3 gives a child's full keys
        for group in GROUPS
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


def _resolve_task_format(c: Components, cfg: DictConfig) -> None:
    """``task.format=auto`` follows the policy: ``chat`` when it prompts through its chat template
    (``policy.chat_template=true``), else ``bare``; an explicit ``bare`` or ``chat`` is kept. The format
    settled on is written back to ``cfg.task.format``, so the config a run logs names it."""
    resolve = getattr(c.task, "resolve_format", None)
    if resolve is None:  # a task of one format (no format option)
        return
    settled = resolve(bool(getattr(c.policy, "chat_template", False)))
    if cfg.task.get("format") == "auto" and not OmegaConf.is_readonly(cfg):
        cfg.task.format = settled


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
    (``task.format=auto`` is settled here from ``policy.chat_template``, in the task and in ``cfg``).
    Nothing heavy is built: no model, no engine.
    """
    _check_missing(cfg)
    engine_cls, checked_args = check_engine(cfg)
    built = {g: build_option(cfg, g) for g in GROUPS if g != "rollout"}
    engine_args = _arguments(cfg.rollout)
    _align_outlier_channels(built["policy"], engine_args)
    eval_engine = None
    copy_args = getattr(engine_cls, "TRAINER_PRECISION_COPY", None)
    if copy_args is not None:
        eval_engine = functools.partial(engine_cls, **{**engine_args, **copy_args})
    components = Components(
        engine=functools.partial(engine_cls, **engine_args), eval_engine=eval_engine, **built
    )
    _resolve_task_format(components, cfg)
    _check_combination(components, cfg, engine_cls, checked_args)
    return components
