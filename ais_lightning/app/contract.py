"""Resume as a contract: what a resume may change, what it refuses, and how the change is recorded.

Every checkpoint records the resolved config that trained it (:class:`ConfigInCheckpoint`). A resume compares
it with its own (:func:`config_changes`) and:

- refuses, before anything is logged, a run whose components' state does not fit the checkpoint's
  (:func:`check_state_fits`: a corrector with other buffers, a policy of other shapes, a reference policy the
  checkpoint lacks), naming the state keys and the config keys that changed; the checkpoint's MLflow run is not
  touched, so a FINISHED run stays FINISHED;
- continues the checkpoint's MLflow run when only how long or how the run is kept changed
  (:data:`CONTINUING_KEYS`: ``trainer.max_steps``, checkpoint frequency, threads, logging, paths), the changes
  recorded in a tag ``config_changes_at_step_<N>``;
- starts a new MLflow run, linked to the old one (tags ``resumed_from_run``, ``resumed_from_step``,
  ``config_changes``), when anything that shapes training changed (another lr, group size, rollout precision,
  a stateless corrector...). MLflow params are write-once and describe the whole run they belong to: a run whose
  recipe changed at step N is two runs, each with params that hold for every step it logged, and the old run
  keeps its params, status and artifacts as they were.

The optimizer's hyperparameters (lr, betas, weight decay) are restored from the checkpoint by Lightning; a
resume that changed them applies them after the restore (:class:`ResumeSettings`), so what is recorded is what
trains.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

CONFIG_CHECKPOINT_KEY = "ais_config"
"""Where a checkpoint records the config that trained it: ``{"config": {flat key: value}, "choices": {group:
option}}``."""

CONTINUING_KEYS = (
    "ckpt_path",
    "output_dir",
    "overwrite",
    "trusted_targets",
    "shortcuts.",
    "trainer.max_steps",
    "trainer.checkpoint_every_n_steps",
    "trainer.keep_checkpoints",
    "trainer.enable_progress_bar",
    "trainer.num_threads",
    "logger.",
    "warmstart.",
)
"""Config keys (or ``group.`` prefixes: the group's keys and its option) a resume may change and still continue
the checkpoint's MLflow run: how long the run goes, how it is kept and logged, where it lives; the warm start does
not apply to a resume."""

STATE_GROUPS = {"policy": "policy", "corrector": "corrector", "loss_fn": "loss", "reference": "loss"}
"""The config group behind each top-level part of the module's state (the reference policy exists when the
loss has a KL term)."""


def run_config(cfg: Any) -> dict[str, Any]:
    """``{"config": flat resolved config, "choices": option per group}``: what a checkpoint records."""
    from ais_lightning.app.tracking import flatten_config, option_choices

    return {"config": flatten_config(cfg), "choices": option_choices()}


class ConfigInCheckpoint(Callback):
    """Lightning callback: every checkpoint records the run's config (:func:`run_config`)."""

    def __init__(self, cfg: Any) -> None:
        self.record = run_config(cfg)

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint[CONFIG_CHECKPOINT_KEY] = self.record


def continuing(key: str) -> bool:
    """Whether changing ``key`` keeps the checkpoint's MLflow run (:data:`CONTINUING_KEYS`)."""
    return any(
        key == k or (k.endswith(".") and (key.startswith(k) or key == k[:-1])) for k in CONTINUING_KEYS
    )


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (checkpoint's value, this run's value)}`` of every flat config key that differs (a key only one
    side has counts, with ``None`` on the other; ``ckpt_path``, where a run starts from, does not); option
    choices are keys too (``corrector``)."""
    old = {**before.get("config", {}), **before.get("choices", {})}
    new = {**after.get("config", {}), **after.get("choices", {})}
    keys = sorted((old.keys() | new.keys()) - {"ckpt_path"})
    return {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}


def describe_changes(changes: dict[str, tuple[Any, Any]], limit: int = 8) -> str:
    """``algorithm.lr: 3e-05 -> 0.0003, corrector: ais -> tis`` (at most ``limit``, then how many more)."""
    parts = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(changes.items())[:limit]]
    more = len(changes) - limit
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def _state_shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(getattr(v, "shape", ())) for k, v in state.items()}


def state_mismatch(module_state: dict[str, Any], checkpoint_state: dict[str, Any]) -> dict[str, list[str]]:
    """Per top-level part of the module (``corrector``, ``policy``...): the state keys only the checkpoint has,
    only the module has, or whose shapes differ, as ``"key (in the checkpoint only)"`` lines; {} when they fit."""
    mine, theirs = _state_shapes(module_state), _state_shapes(checkpoint_state)
    found: dict[str, list[str]] = {}
    for key in sorted(mine.keys() | theirs.keys()):
        if key not in mine:
            what = "in the checkpoint only"
        elif key not in theirs:
            what = "not in the checkpoint"
        elif mine[key] != theirs[key]:
            what = f"shape {list(theirs[key])} in the checkpoint, {list(mine[key])} here"
        else:
            continue
        found.setdefault(key.split(".", 1)[0], []).append(f"{key} ({what})")
    return found


def check_state_fits(
    module: Any, checkpoint: dict[str, Any], changes: dict[str, tuple[Any, Any]] | None, ckpt_path: str
) -> None:
    """ValueError when the checkpoint's state cannot be loaded into ``module``, naming the parts whose state
    differs (a few keys each) and the config keys that changed in their groups (``changes``; None when the
    checkpoint records no config)."""
    saved = checkpoint.get("state_dict")
    if not isinstance(saved, dict):
        return  # not a Lightning fit checkpoint: Lightning says so itself
    mismatch = state_mismatch(module.state_dict(), saved)
    if not mismatch:
        return
    parts = []
    for part, keys in mismatch.items():
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        parts.append(f"{part}: {'; '.join(keys[:3])}{more}")
    groups = {STATE_GROUPS.get(part, part) for part in mismatch}
    related = {k: v for k, v in (changes or {}).items() if k.split(".", 1)[0] in groups}
    if related:
        cause = f"this run changed {describe_changes(related, limit=3)}"
    elif changes is None:
        cause = "the checkpoint records no config to compare with (written by an older ais-train)"
    else:
        cause = f"no key of {sorted(groups)} changed in the config: the components' code did"
    raise ValueError(
        f"ckpt_path={ckpt_path}: this run cannot continue the checkpoint's run: the state of "
        f"{', '.join(sorted(groups))} does not fit ({' | '.join(parts)}); {cause}. Resume with the checkpoint's "
        "values, or start a new run from scratch in another hydra.run.dir"
    )


class ResumeSettings(Callback):
    """Lightning callback of a resumed run: after Lightning restored the optimizer from the checkpoint (its
    lr, betas and weight decay included), set them to the run's settings (``pl_module.settings``, a
    ``GRPOSettings``), so a resume that changed them trains with the new values."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        settings = pl_module.settings
        wanted = {"lr": settings.lr, "betas": tuple(settings.betas), "weight_decay": settings.weight_decay}
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group.update({key: value for key, value in wanted.items() if key in group})
