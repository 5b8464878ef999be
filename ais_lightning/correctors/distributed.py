"""Exact batch statistics under data parallelism: sum or gather across ranks when a process group exists.

Correctors that use statistics of the whole batch (batch-normalised IS weights, M2PO's adaptive
mask, Pareto smoothing) call these helpers, so that every rank computes the value of the
concatenated global batch (as ``AIS`` does with its sufficient statistics). Without an initialized
``torch.distributed`` process group they are the identity. They are collectives: every rank must
call them, in the same order (torchmetrics #3199).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a default process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(stats: torch.Tensor) -> torch.Tensor:
    """``stats`` summed over ranks (in place when distributed); the input itself otherwise."""
    if is_distributed():
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return stats


def all_gather_values(values: torch.Tensor) -> torch.Tensor:
    """The 1-D ``values`` of every rank, concatenated in rank order.  # [sum of the ranks' N]

    Ranks may hold different numbers of values: each pads to the largest count, gathers, and drops
    the padding. Without a process group the input is returned unchanged.
    """
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D, got shape {tuple(values.shape)}")
    if not is_distributed():
        return values
    world = dist.get_world_size()
    count = torch.tensor([values.numel()], dtype=torch.long, device=values.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    sizes = [int(c.item()) for c in counts]
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:n] for g, n in zip(gathered, sizes)])
