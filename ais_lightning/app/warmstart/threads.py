"""Intra-op thread control: the warm start runs with a fixed thread count, so its weights do not depend on the
run's (reduction order changes with the thread count, and the SFT amplifies it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["intra_op_threads"]


@contextlib.contextmanager
def intra_op_threads(num_threads: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(num_threads)`` (0 = unchanged); restore it after."""
    before = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
