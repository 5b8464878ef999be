"""Before a run trains: will its checkpoints fit on the disk? A warning with the sizes, never a refusal (the size
is an estimate, and space may be freed while the run trains); a full disk mid-run is still handled by the verified
writes (``ais_lightning.files``), but hours later.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ais_lightning.modules.trainer_memory import ADAMW_STATES

if TYPE_CHECKING:
    from ais_lightning.app.trainer import TrainerSettings
    from ais_lightning.modules.grpo import GRPOModule

log = logging.getLogger(__name__)


def tensor_bytes(tensors: Iterable[object]) -> int:
    """Bytes of the storages of the tensors in an iterable, each storage once however many tensors view it (tied
    weights), as ``torch.save`` writes them; anything else in the iterable counts 0."""
    storages = [t.untyped_storage() for t in tensors if isinstance(t, torch.Tensor)]
    # a storage without memory (the meta device, not materialized yet) has address 0: each counts on its own
    return sum({s.data_ptr() or f"no memory {i}": s.nbytes() for i, s in enumerate(storages)}.values())


def checkpoint_bytes(state: int, trained: int, snapshot: int = 0, snapshots: int = 0) -> int:
    """One checkpoint's size, about: the module's ``state`` bytes, AdamW's two moments of the ``trained``
    parameters' bytes, and ``snapshots`` kept policy versions of ``snapshot`` bytes each (an asynchronous run keeps
    them in its checkpoints)."""
    return state + ADAMW_STATES * trained + snapshots * snapshot


def checkpoint_files(max_steps: int, every_n_steps: int, keep: int) -> int:
    """The most checkpoint files a run holds at once: the periodic ones it keeps (``max_steps // every_n_steps``, at
    most ``keep`` when set), ``last.ckpt``, and the one being written (a temporary file until it is published)."""
    periodic = max_steps // every_n_steps if every_n_steps else 0
    return (min(periodic, keep) if keep else periodic) + 2


def space_warning(one: int, files: int, free: int, directory: Path) -> str | None:
    """The warning when ``files`` checkpoints of ``one`` byte each need more than ``free`` bytes, else None."""
    need = one * files
    if need <= free:
        return None
    gb = 1e9
    return (
        f"the checkpoints of this run may not fit under {directory}: about {need / gb:.2f} GB ({files} files of "
        f"~{one / gb:.2f} GB: the periodic ones kept, last.ckpt and the one being written), {free / gb:.2f} GB "
        "free. Set trainer.keep_checkpoints, checkpoint less often (trainer.checkpoint_every_n_steps) or free "
        "space; a full disk stops the run at its next checkpoint, the earlier ones intact"
    )


def check_checkpoint_space(module: GRPOModule, trainer: TrainerSettings, output_dir: str | Path) -> int:
    """Log the estimated size of one checkpoint of ``module`` and warn when the run's checkpoints (by the ``trainer``
    settings' ``max_steps``, ``checkpoint_every_n_steps``, ``keep_checkpoints``) may not fit under ``output_dir``;
    returns the estimate in bytes."""
    params = list(module.policy.parameters())
    one = checkpoint_bytes(
        state=tensor_bytes(module.state_dict().values()),
        trained=tensor_bytes(p for p in params if p.requires_grad),
        snapshot=tensor_bytes(params),
        snapshots=module.staleness.snapshots.keep if module.staleness is not None else 0,
    )
    files = checkpoint_files(trainer.max_steps, trainer.checkpoint_every_n_steps, trainer.keep_checkpoints)
    directory = Path(output_dir)
    log.info("checkpoints: about %.2f MB each, at most %d at once", one / 1e6, files)
    warning = space_warning(one, files, shutil.disk_usage(directory).free, directory)
    if warning:
        log.warning(warning)
    return one
