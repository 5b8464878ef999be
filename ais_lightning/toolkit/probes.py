"""The run builder of the tools under ``tools/`` and probes of ``ais-train``'s own loop (the library and
``ais-train`` never import this).

Every tool builds what it measures as ``ais-train`` does: :func:`compose` composes the config from the same
command-line overrides (``policy=smollm2 rollout=int8 task.digits=3 ...``) and validates it with
``ais_lightning.app.build.validate``, whose components build the policy (``policy.build(seed)``), the engines
(``engine(model)``) and the task. On top of that: :func:`engine_factory` (the engine of one more rollout setting,
e.g. ``precision="fp8"``), :func:`fp32_engine` (the run's engine at the trainer's precision),
:func:`training_engine` (an engine built as ``GRPOModule`` builds it), :func:`policy_like` (the same weights under
another policy option, e.g. ``policy.dtype=bfloat16``), a Trainer that only trains
(:func:`measuring_trainer`) and a harness that drives rollout steps through a ``GRPOModule`` subclass that
measures them (:func:`run_probe`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_QUOTED = set(" ,[]{}()'\"\\=")
"""Characters that make an override value a quoted string in Hydra's grammar."""


def override(key: str, value: Any) -> str:
    """The ``ais-train`` command-line override that sets ``key`` to the Python ``value``: None -> ``null``, bools
    ``true``/``false``, lists ``[a,b]``, strings quoted where Hydra's grammar needs it.

    >>> override("rollout.outlier_fraction", None), override("warmstart.target_band", [0.65, 0.75])
    ('rollout.outlier_fraction=null', 'warmstart.target_band=[0.65,0.75]')
    """

    def text(v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(text(x) for x in v) + "]"
        s = str(v)
        if isinstance(v, str) and (not s or _QUOTED & set(s)):
            return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return s

    return f"{key}={text(value)}"


def compose(overrides: Sequence[str]) -> tuple[Any, Any]:
    """``(cfg, components)``: the ``ais-train`` config composed from ``overrides`` (as on its command line) and
    validated as ``ais-train`` validates it (``ais_lightning.app.build.validate``: every error a ValueError naming the
    key). ``components.policy.build(seed)`` makes the policy, ``components.engine(model)`` the rollout engine,
    ``components.task`` is the task: what every tool measures is built from these."""
    from ais_lightning.app.build import validate
    from ais_lightning.app.config import compose_train_config

    cfg = compose_train_config(["output_dir=unused", *overrides])
    return cfg, validate(cfg)


def engine_factory(overrides: Sequence[str], **rollout: Any) -> Callable[..., Any]:
    """The rollout-engine builder of the config composed from ``overrides`` with ``rollout.<key>=<value>`` for each
    of ``rollout`` (e.g. ``precision="fp8"``, ``outlier_fraction=0``), validated: ``factory(model)`` builds the
    engine on ``model`` (:func:`training_engine` builds it as training does)."""
    return compose([*overrides, *(override(f"rollout.{k}", v) for k, v in rollout.items())])[1].engine


def fp32_engine(components: Any, overrides: Sequence[str]) -> Callable[..., Any]:
    """The builder of the run's engine at the trainer's precision: its trainer-precision copy
    (``components.eval_engine``, what validation uses), else, for an engine without one (vLLM), the torch engine at
    fp32 (``rollout=fp32``; the other ``rollout`` keys of ``overrides``, the first engine's, left out)."""
    if components.eval_engine is not None:
        return components.eval_engine
    kept = [o for o in overrides if not o.lstrip("+~").startswith("rollout")]
    return compose([*kept, "rollout=fp32"])[1].engine


def training_engine(policy: Any, factory: Callable[..., Any]) -> Any:
    """An engine built as ``GRPOModule`` builds it: ``factory`` on a fresh model of the policy's config, then the
    policy's weights through ``sync_weights(policy.full_state_dict())``."""
    engine = factory(policy.fresh_model())
    engine.sync_weights(policy.full_state_dict())
    return engine


def policy_like(spec: Any, weights: Any, seed: int = 0) -> Any:
    """The policy the policy spec ``spec`` builds (``Components.policy`` of a config, e.g. one composed with
    ``policy.dtype=bfloat16``, ``policy.aligned_quantization=int4`` or ``policy.router_replay=true``) carrying the
    weights of the policy ``weights`` (its model's state dict, cast to the new policy's dtype): the same model under
    other policy settings."""
    policy = spec.build(seed)
    policy.model.load_state_dict(weights.model.state_dict())
    return policy


def add_overrides_argument(parser: Any, default: Sequence[str] = ()) -> None:
    """The positional ``ais-train`` overrides of a tool's command line (also accepted after ``--``); parse with
    ``parser.parse_intermixed_args`` so that options and overrides may mix."""
    shown = f" (default: {' '.join(default)})" if default else ""
    parser.add_argument(
        "overrides",
        nargs="*",
        help=f"ais-train overrides, as on its command line (e.g. policy=smollm2 rollout=int8){shown}",
    )


def write_json(path: str | Path | None, data: Any, indent: int = 2) -> None:
    """Write ``data`` as JSON to ``path`` (nothing when ``path`` is None: the tool's ``--json`` was not given)."""
    if path:
        Path(path).write_text(json.dumps(data, indent=indent))


def quiet_run_logs() -> None:
    """Quiet what an in-process ``ais-train`` run prints besides a tool's results: the known warnings
    (``ais_lightning.app.noise.silence_known_noise``), the tokenizers' fork warning and Lightning's info lines."""
    import logging
    import os

    from ais_lightning.app.noise import silence_known_noise

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    silence_known_noise()
    import lightning.pytorch  # noqa: F401  (sets its logger's level on import: quiet it afterwards)

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # "GPU available", "max_steps reached"


def one_process(components: Any, tool: str, warm_start: bool = True, threads: int | None = None) -> None:
    """Refuse a run a tool drives in this one process cannot make (``trainer.strategy`` other than ``auto``; a warm
    start when ``warm_start`` is False), naming ``tool``; then set torch's intra-op threads to ``threads``, else
    ``trainer.num_threads`` (if set)."""
    import torch

    c = components
    if c.trainer.strategy != "auto" or (not warm_start and c.warmstart.enabled):
        what = (
            "(trainer.strategy=auto)"
            if warm_start
            else "without a warm start (trainer.strategy=auto, warmstart)"
        )
        raise ValueError(f"{tool} runs one process {what}")
    if threads or c.trainer.num_threads:
        torch.set_num_threads(threads or c.trainer.num_threads)


def measuring_trainer(
    root: str | Path, max_steps: int, precision: str = "32-true", callbacks: Any = ()
) -> Any:
    """A one-process CPU Trainer that only trains: no validation, checkpoint, logger, bar or summary.

    For tools that drive the GRPO loop to measure it (``tools/train_speed.py``, :func:`run_probe`).
    """
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=list(callbacks),
        default_root_dir=root,
    )


@dataclass
class ProbeRun:
    """What :func:`run_probe` leaves: the validated components, the fitted probe module, the warm start."""

    components: Any
    probe: Any
    warm: Any
    seconds: float


def run_probe(overrides: list[str], batches: int, seed: int, module_class: type, tool: str) -> ProbeRun:
    """Drive ``batches`` rollout steps of ``ais-train``'s own pipeline through ``module_class``, one process.

    The config is composed from ``overrides`` and validated as ``ais-train`` does; the policy starts from
    the run's (cached) warm start; ``module_class`` is a ``GRPOModule`` subclass whose ``training_step``
    measures a rollout batch (e.g. ``tools/gradient_noise.py``). ``tool`` names the caller in errors.
    """
    import tempfile
    import time

    import lightning as L

    from ais_lightning.app.noise import silence_known_noise

    silence_known_noise()
    cfg, c = compose([*overrides, f"seed={seed}"])
    one_process(c, tool)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    policy, warm = c.initial_policy(cfg.seed)  # ais-train's starting weights (its cached warm start)
    probe = c.grpo_module(policy, cfg.seed, module_class=module_class, validation=False)
    data = c.prompt_data(batches, cfg.seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{tool}_") as root:
        max_steps = batches * c.algorithm.optimizer_steps_per_rollout
        measuring_trainer(root, max_steps, c.trainer.precision).fit(probe, datamodule=data)
    return ProbeRun(c, probe, warm, time.perf_counter() - started)


def probe_experience(module: Any, batch: dict[str, list]) -> tuple[Any, float]:
    """One rollout batch of a :func:`run_probe` module: ``(experience, mismatch KL k3)``.

    Collects the batch's experience as ``GRPOModule.training_step`` does (rollout, rewards, π_old, the
    corrector) and reads and resets the module's mismatch metric. Raises if the batch has non-finite
    log-probs: there is nothing to measure.
    """
    from ais_lightning.tasks import task_fields

    exp, _ = module.collect_experience(batch["prompt"], task_fields(batch))
    kl = float(module.mismatch.compute()["mismatch/kl_k3"])
    module.mismatch.reset()
    if exp is None:
        raise RuntimeError("non-finite log-probs in a rollout batch: nothing to measure")
    return exp, kl


def probe_main(
    argv: list[str] | None,
    description: str,
    default_overrides: list[str],
    default_batches: int,
    measure: Any,
    format_result: Any,
) -> int:
    """The command line of a :func:`run_probe` tool: ``[OVERRIDES...] [--batches N] [--seed S] [--json PATH]``.

    Runs ``measure(overrides, batches, seed)`` (a dict), prints ``format_result`` of it, writes it as JSON.
    """
    import argparse

    parser = argparse.ArgumentParser(description=description)
    add_overrides_argument(parser, default_overrides)
    parser.add_argument(
        "--batches",
        type=int,
        default=default_batches,
        help=f"rollout batches at fixed weights (default {default_batches})",
    )
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (prompts and sampling)")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_intermixed_args(argv)
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    result = measure(args.overrides or default_overrides, args.batches, args.seed)
    print(format_result(result))
    write_json(args.json, result)
    return 0
