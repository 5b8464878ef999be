"""Helpers for end-to-end tests: run ``ais-train`` in a subprocess on the tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A seconds-long run: tiny model, no warm-start, a few rollout steps.
SMOKE = ["experiment=smoke", "trainer.num_threads=1"]

RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "WORLD_SIZE")
"""Where torch.distributed processes meet: a leftover from another test (or a cluster job) misroutes a
local multi-process run."""


def run_train(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600):
    """``python -m ais_lightning.train ARGS`` in ``cwd``; raises with the output on failure."""
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "AIS_LIGHTNING_CACHE": str(cwd / "cache")}
    full_env.pop("MLFLOW_TRACKING_URI", None)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "ais_lightning.train", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"ais-train {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc
