"""Helpers of the Ray tests: the Ray processes on this machine, and a small source on the tiny model."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.policy.gather import full_state_dict
from ais_lightning.rollout import TorchRolloutEngine

ray = pytest.importorskip("ray", reason="Ray is an optional extra (make install installs it)")

MARKERS = (
    "raylet",
    "gcs_server",
    "default_worker.py",
    "ray::",
    "ray/dashboard",
    "log_monitor.py",
    "monitor.py",
)
"""What the command line of a process Ray started holds."""


def ray_processes() -> set[int]:
    """The pids of Ray's processes on this machine (cluster services, workers)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if any(marker in cmdline for marker in MARKERS) and "pytest" not in cmdline:
            pids.add(int(proc.name))
    return pids


def tiny_parts() -> tuple[object, object, list]:
    """``(model, engine factory, weights)`` of the tiny Qwen3 with an fp32 torch engine."""
    model = build_tiny_qwen3(seed=0)
    factory = functools.partial(TorchRolloutEngine, precision="fp32")
    return model, factory, full_state_dict(model)
