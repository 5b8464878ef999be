"""Warm-start cache: SFT the policy on a task once, reuse the result on every later run.

The cache key hashes everything that changes the result (model config, task, SFT settings,
seed). A finished warm-start is written to a temporary directory and renamed into place, so a
crash mid-training never leaves a half-written model that a later run would load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch

from ais_lightning.modules.sft import SFTModule
from ais_lightning.policy import Policy
from ais_lightning.tasks import PromptDataModule, Task

CACHE_VERSION = 1


def default_cache_dir() -> Path:
    root = os.environ.get(
        "AIS_LIGHTNING_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "ais_lightning")
    )
    return Path(root) / "warmstart"


def cache_key(
    model_config: dict[str, Any], task_name: str, task_params: dict[str, Any], sft: dict[str, Any]
) -> str:
    """A short, stable hash of everything that determines the warm-started weights."""
    payload = {
        "version": CACHE_VERSION,
        "model": {k: v for k, v in sorted(model_config.items()) if not k.startswith("_")},
        "task": task_name,
        "task_params": task_params,
        "sft": sft,
        "torch": torch.__version__.split("+")[0],
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def warm_start(
    policy: Policy,
    tokenizer: Any,
    task: Task,
    task_name: str,
    task_params: dict[str, Any],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    cache_dir: str | os.PathLike | None = None,
    progress_bar: bool = True,
) -> tuple[Policy, Path, bool]:
    """SFT ``policy`` in place on ``task`` (or load the cached result).

    Returns ``(policy, cache_path, from_cache)``.
    """
    sft = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed}
    key = cache_key(policy.model.config.to_dict(), task_name, task_params, sft)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    path = root / key
    weights = path / "policy.pt"
    if weights.exists():
        policy.model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        return policy, path, True

    L.seed_everything(seed, workers=True, verbose=False)
    data = PromptDataModule(task, train_size=steps * batch_size, val_size=1, batch_size=batch_size, seed=seed)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(SFTModule(policy, tokenizer, lr=lr), datamodule=data)

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        torch.save(policy.model.state_dict(), tmp / "policy.pt")
        (tmp / "meta.json").write_text(
            json.dumps({"task": task_name, "task_params": task_params, **sft}, indent=2)
        )
        os.replace(tmp, path) if not path.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return policy, path, False
