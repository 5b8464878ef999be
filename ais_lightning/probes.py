"""Probes of ``ais-train``'s own loop for the measurement tools under ``tools/`` (the library and ``ais-train``
never import this): a Trainer that only trains, and a harness that drives rollout steps through a
``GRPOModule`` subclass that measures them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    import torch

    from ais_lightning.build import validate
    from ais_lightning.config import compose_train_config
    from ais_lightning.noise import silence_known_noise

    silence_known_noise()
    cfg = compose_train_config([*overrides, f"seed={seed}", "output_dir=unused"])
    c = validate(cfg)
    if c.trainer.strategy != "auto":
        raise ValueError(f"{tool} runs one process (trainer.strategy=auto)")
    if c.trainer.num_threads:
        torch.set_num_threads(c.trainer.num_threads)
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
    import json

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "overrides", nargs="*", help=f"ais-train overrides (default: {' '.join(default_overrides)})"
    )
    parser.add_argument(
        "--batches",
        type=int,
        default=default_batches,
        help=f"rollout batches at fixed weights (default {default_batches})",
    )
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (prompts and sampling)")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    result = measure(args.overrides or default_overrides, args.batches, args.seed)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
