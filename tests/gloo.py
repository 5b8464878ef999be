"""The gloo group of the multi-process tests: one way to open it and one way to close it.

Closing is where multi-process tests flake. If a rank tears down its gloo connections while its
peer is still finishing a collective, or if FSDP modules (reference cycles, collected late) keep the
process group alive into interpreter shutdown, gloo's worker threads can abort the process
(``terminate called without an active exception``, SIGABRT) after every assertion passed. So on
success every rank collects its garbage and meets the others at a barrier before any rank destroys
the group. On failure the rank skips the barrier (its peers would wait for it) and
``torch.multiprocessing.spawn`` reports the error and stops the others.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from ais_lightning.toolkit.mlflow_server import free_port


@contextmanager
def gloo_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    """``init_process_group('gloo')`` on 127.0.0.1:``port``; on leaving, a barrier (on success) and a destroy."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield
        gc.collect()  # FSDP-wrapped modules die here, while the group is still up, not at interpreter exit
        dist.barrier()  # no rank closes its connections while a peer is inside a collective
    finally:
        dist.destroy_process_group()


__all__ = ["free_port", "gloo_group"]
