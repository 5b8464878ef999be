"""Helpers for end-to-end tests: run ``ais-train`` in a subprocess on the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A seconds-long run: tiny model, no warm-start, a few rollout steps.
SMOKE = ["experiment=smoke", "trainer.num_threads=1"]

RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "WORLD_SIZE")
"""Where torch.distributed processes meet: a leftover from another test (or a cluster job) misroutes a
local multi-process run."""


def local_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without rendezvous or SLURM variables: a local run starts its own ranks."""
    env = {
        k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES and not k.startswith("SLURM_")
    }
    env.update(extra or {})
    return env


def run_process(
    command: list[str], cwd: Path | None, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """``command`` in its own process group; on timeout the whole group is killed (a multi-process run's other
    ranks included, which would otherwise wait for their rank 0 and hold a core), then TimeoutExpired."""
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def run_train(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600):
    """``python -m ais_lightning.app.train ARGS`` in ``cwd``; raises with the output on failure."""
    full_env = local_env({"TOKENIZERS_PARALLELISM": "false", "AIS_LIGHTNING_CACHE": str(cwd / "cache")})
    full_env.pop("MLFLOW_TRACKING_URI", None)
    full_env.update(env or {})
    proc = run_process([sys.executable, "-m", "ais_lightning.app.train", *args], cwd, full_env, timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"ais-train {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc
