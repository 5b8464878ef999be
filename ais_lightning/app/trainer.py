"""The Lightning Trainer of ``ais-train``: its settings (the ``trainer`` group), strategy and callbacks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ais_lightning.checks import check_int

STRATEGIES = ("auto", "fsdp2", "fsdp")
"""``auto`` (one process), ``fsdp2`` (ModelParallelStrategy, FSDP2 ``fully_shard``; runs on CPU over gloo
and on GPUs over NCCL: ``trainer=fsdp2`` and ``trainer=fsdp_gpu``), ``fsdp`` (Lightning's FSDPStrategy,
FSDP1, CUDA only; ``Policy.full_state_dict`` then needs ``fsdp_root``, see its docstring)."""
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")


@dataclass
class TrainerSettings:
    """Lightning Trainer settings (the ``trainer`` group of ``ais-train``); each default lives here only."""

    max_steps: int = 200
    """Training (rollout) steps."""
    accelerator: str = "cpu"
    """cpu | gpu | cuda | auto."""
    devices: Any = 1
    """Devices (processes) per node: an int, a list of device ids, or "auto"."""
    num_nodes: int = 1
    """Nodes (machines); with a cluster launcher (SLURM, torchrun) every node runs the same command."""
    strategy: str = "auto"
    """auto | fsdp2 (ModelParallelStrategy, FSDP2 fully_shard; CPU or GPU) | fsdp (FSDPStrategy, CUDA only)."""
    precision: str = "32-true"
    """Lightning precision plugin (the trainer's precision)."""
    checkpoint_every_n_steps: int = 0
    """Save a checkpoint every N rollout steps (0 = only at the end)."""
    keep_checkpoints: int = 0
    """Keep the N newest of the periodic checkpoints, deleting older ones (0 = keep every one); ``last.ckpt`` is
    always kept. Needs ``checkpoint_every_n_steps``."""
    enable_progress_bar: bool = True
    """Show a progress bar."""
    num_threads: int | None = None
    """torch intra-op threads (None = torch's default)."""

    def __post_init__(self) -> None:
        for name, minimum in (
            ("max_steps", 1),
            ("num_nodes", 1),
            ("checkpoint_every_n_steps", 0),
            ("keep_checkpoints", 0),
        ):
            check_int(getattr(self, name), name, minimum)
        if self.keep_checkpoints and not self.checkpoint_every_n_steps:
            raise ValueError(
                f"keep_checkpoints={self.keep_checkpoints} keeps periodic checkpoints, but "
                "checkpoint_every_n_steps is 0 (only last.ckpt is written): set checkpoint_every_n_steps too"
            )
        if self.num_threads is not None and (
            isinstance(self.num_threads, bool)
            or not isinstance(self.num_threads, int)
            or self.num_threads < 1
        ):
            raise ValueError(f"num_threads must be None or an int >= 1, got {self.num_threads!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {self.strategy!r}")
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {list(ACCELERATORS)}, got {self.accelerator!r}")
        if isinstance(self.devices, int) and not isinstance(self.devices, bool) and self.devices < 1:
            raise ValueError(f"devices must be >= 1, a list of device ids or 'auto', got {self.devices!r}")

    @property
    def world_size(self) -> int:
        """Processes in the run when known from the settings (1 when ``devices`` is not an int)."""
        per_node = self.devices if isinstance(self.devices, int) else len(self.devices or []) or 1
        return per_node * self.num_nodes

    def on_gpu(self) -> bool:
        """Whether the run trains on CUDA GPUs (``auto`` picks them when CUDA is available, as Lightning does)."""
        import torch

        if self.accelerator == "auto":
            return torch.cuda.is_available()
        return self.accelerator in ("gpu", "cuda")

    def devices_per_node(self) -> int:
        """Processes per node as Lightning will start them: an int, a list of ids, ``"auto"``/-1/``"-1"``
        (every visible GPU; one CPU process), or a string of ids (``"0,1"``) or a count (``"2"``)."""
        import torch

        devices = self.devices
        if isinstance(devices, str) and devices.strip() not in ("auto", "-1"):
            text = devices.strip()
            if "," in text:
                return len([d for d in text.split(",") if d.strip()])
            return int(text)
        if isinstance(devices, (list, tuple)):
            return len(devices)
        if devices in ("auto", -1) or (isinstance(devices, str) and devices.strip() in ("auto", "-1")):
            return max(torch.cuda.device_count(), 1) if self.on_gpu() else 1
        return int(devices)

    def strategy_object(self, decoder_layer: type | None = None) -> Any:
        """The Lightning strategy for ``strategy`` (``decoder_layer``: FSDP1's auto-wrap unit).

        ``fsdp2``: Lightning's ``ModelParallelStrategy`` with every process in the data-parallel dimension
        (``data_parallel_size`` = devices x nodes, ``tensor_parallel_size=1``: the device mesh FSDP2 shards
        over); gloo on CPU, NCCL on GPUs. Its ``"auto"`` data-parallel size would be the node count
        (``strategies/model_parallel.py``, ``setup_environment``), which fails the mesh check
        ``data_parallel_size * tensor_parallel_size == world_size`` of any multi-device node.
        """
        if self.strategy == "fsdp2":
            import torch
            from lightning.pytorch.strategies import ModelParallelStrategy

            gpu = self.on_gpu()
            if gpu and not torch.cuda.is_available():
                raise ValueError(
                    f"trainer.accelerator={self.accelerator} with trainer.strategy=fsdp2 (FSDP2 over NCCL) "
                    "needs CUDA GPUs; none is available (on CPU use trainer=fsdp2: gloo)"
                )
            return ModelParallelStrategy(
                data_parallel_size=self.devices_per_node() * self.num_nodes,
                tensor_parallel_size=1,
                process_group_backend="nccl" if gpu else "gloo",
            )
        if self.strategy == "fsdp":
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    "trainer.strategy=fsdp (Lightning FSDPStrategy) needs CUDA; on CPU use trainer=fsdp2"
                )
            from lightning.pytorch.strategies import FSDPStrategy

            wrap = {decoder_layer} if decoder_layer is not None else None
            return FSDPStrategy(auto_wrap_policy=wrap, state_dict_type="full")
        return "auto"


def progress_bar(label: str) -> Any:
    """Lightning's TQDM progress bar labelled with what is being trained ("GRPO", "SFT warm start").

    Lightning's default bar (Rich when installed) labels an epoch-less run "Epoch 0/-2"; a run here is
    counted in steps, so the bar shows the label, the step count and the logged progress metrics.
    """
    from lightning.pytorch.callbacks import TQDMProgressBar

    class StepProgressBar(TQDMProgressBar):
        def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
            super().on_train_epoch_start(trainer, *args)
            self.train_progress_bar.set_description(label)

    return StepProgressBar()


def checkpoint_callback(output_dir: str | Path, every_n_train_steps: int | None, keep: int = 0) -> Any:
    """Checkpoints under ``<output_dir>/checkpoints``: ``last.ckpt`` always, every N optimizer steps if set, of
    which the ``keep`` newest stay (0 = all)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if every_n_train_steps and keep:
        # Lightning keeps the top k by a monitored value: the global step (always a candidate) ranks by age
        kept: dict[str, Any] = {"monitor": "step", "mode": "max", "save_top_k": keep}
    else:  # monitor and mode at Lightning's defaults: the callback's state key of earlier checkpoints
        kept = {"save_top_k": -1 if every_n_train_steps else 1}
    return ModelCheckpoint(
        dirpath=Path(output_dir) / "checkpoints",
        filename="step{step:06d}",  # no "=" in the name: Hydra overrides (ckpt_path=...) take it unquoted
        auto_insert_metric_name=False,
        save_last=True,
        every_n_train_steps=every_n_train_steps,
        enable_version_counter=False,  # a resumed run overwrites last.ckpt: "last" is always the newest
        **kept,
    )


def build_trainer(
    settings: TrainerSettings, algorithm: Any, output_dir: str, logger: Any, policy: Any, callbacks: list[Any]
) -> Any:
    """``ais-train``'s Lightning Trainer: ``settings.max_steps`` rollout steps of the ``algorithm``'s
    ``optimizer_steps_per_rollout`` optimizer steps, validation every ``algorithm.val_every_n_steps`` rollout
    steps (none before training: the run validates first itself), verified checkpoints under
    ``<output_dir>/checkpoints`` (every ``checkpoint_every_n_steps`` rollout steps, the ``keep_checkpoints`` newest
    kept, and ``last.ckpt``),
    ``callbacks`` first, then the checkpoint callback and a step-counting progress bar. FSDP shards the
    ``policy`` by its decoder layers. Under SLURM, Lightning's own requeue handler is off: the run's
    :class:`ais_lightning.app.preemption.Preemption` callback handles SIGUSR1."""
    import lightning as L

    from ais_lightning.app.preemption import slurm_plugins
    from ais_lightning.app.resume import MLflowRunInCheckpoint
    from ais_lightning.files import VerifiedCheckpointIO

    steps_per_rollout = algorithm.optimizer_steps_per_rollout
    every = settings.checkpoint_every_n_steps * steps_per_rollout or None
    bar = [progress_bar("GRPO")] if settings.enable_progress_bar else []
    return L.Trainer(
        accelerator=settings.accelerator,
        devices=settings.devices,
        num_nodes=settings.num_nodes,
        strategy=settings.strategy_object(type(policy.decoder_layers()[0])),
        precision=settings.precision,
        max_steps=settings.max_steps * steps_per_rollout,
        val_check_interval=min(
            algorithm.val_every_n_steps, settings.max_steps
        ),  # in training batches = rollout steps
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=logger,
        # every checkpoint gets a SHA-256 sidecar, checked on resume; under SLURM, Lightning's requeue handler off
        plugins=[VerifiedCheckpointIO(), *slurm_plugins()],
        callbacks=[
            *callbacks,
            checkpoint_callback(output_dir, every, settings.keep_checkpoints),
            MLflowRunInCheckpoint(logger, output_dir),
            *bar,
        ],
        enable_progress_bar=settings.enable_progress_bar,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=output_dir,
    )


def validate_and_fit(
    trainer: Any, module: Any, data: Any, resume: Any, stops: list[Any], logger: Any
) -> tuple[str, dict[str, float]]:
    """Validate the starting weights, then ``fit``; returns ``(status, recovered validation)``.

    ``status``: ``finished``, or ``sigterm`` / ``sigint`` / ``preempted`` when a signal ended the run (the
    summary and the exit code report it). ``stops``: the run's signal guards
    (:class:`ais_lightning.app.signals.SigtermGuard`, :class:`ais_lightning.app.preemption.Preemption`), checked
    between Lightning's entry points. A fresh run validates before RL (the reference for the end of the run); a
    resume (``resume``: :class:`ais_lightning.app.resume.Resume`) instead runs the validation due right after
    its checkpoint that ``fit`` would skip, and returns its values.
    """
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from ais_lightning.app.preemption import Preempted
    from ais_lightning.app.resume import recover_validation
    from ais_lightning.app.tracking import reopen_run

    def check_stops() -> None:
        for stop in stops:
            stop.raise_if_received()

    recovered: dict[str, float] = {}
    try:
        check_stops()
        if resume.ckpt_path is None:
            (start,) = trainer.validate(module, datamodule=data, verbose=False)
            module.validation_start = {k: float(v) for k, v in start.items()}
            reopen_run(logger)  # validate() finalized the MLflow run; fit() is still to come
        elif (skipped := resume.skipped_validation(int(trainer.val_check_interval))) is not None:
            recovered = recover_validation(trainer, module, data, resume.ckpt_path, logger, *skipped)
        check_stops()  # e.g. during validate()'s last batch, which Lightning does not check
        trainer.fit(module, datamodule=data, ckpt_path=resume.ckpt_path)
    except Preempted:
        return "preempted", recovered
    except SIGTERMException:
        return "sigterm", recovered
    except SystemExit as exc:  # Lightning turns Ctrl+C into sys.exit(1) after finalizing the loggers
        if isinstance(exc.__context__, KeyboardInterrupt) and trainer.state.status.value == "interrupted":
            return "sigint", recovered
        raise RuntimeError(  # not a signal: code of the run's own (a component, a callback) called sys.exit
            f"SystemExit({exc.code!r}) raised during training: a component or callback called sys.exit"
        ) from exc
    except KeyboardInterrupt:
        return "sigint", recovered
    return "finished", recovered
