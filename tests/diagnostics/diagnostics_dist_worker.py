"""Worker of the 2-process gloo sync test (imported by name in the spawned processes).

Not a test module: ``test_distributed_sync.py`` puts this directory on ``sys.path`` so that
``torch.multiprocessing.spawn`` can pickle ``run`` by reference.
"""

from __future__ import annotations

import torch

from ais_lightning.diagnostics import CorrectionFraction, MismatchDiagnostics, TokenEntropy
from tests.gloo import gloo_group

SCENARIOS = ("uneven", "one_rank_empty")


def make_shard(scenario: str, rank: int) -> dict[str, torch.Tensor]:
    """Deterministic data of one rank; shards differ in batch size and length."""
    b, t = (4, 5) if rank == 0 else (3, 7)
    gen = torch.Generator().manual_seed(100 * SCENARIOS.index(scenario) + rank)
    rollout = -torch.rand(b, t, generator=gen) * 3.0  # [B, T]
    train = rollout + torch.randn(b, t, generator=gen)  # [B, T]
    mask = torch.rand(b, t, generator=gen) < 0.8  # [B, T]
    if rank == 1:  # the global min / max ratio sit on rank 1, so the min / max sync is exercised
        train[0, :2] = rollout[0, :2] + torch.tensor([6.0, -6.0])
        mask[0, :2] = True
    if scenario == "one_rank_empty" and rank == 1:
        mask = torch.zeros_like(mask)
    corrected = mask & (torch.rand(b, t, generator=gen) < 0.7)
    weights = torch.where(train > rollout + 0.5, torch.full_like(train, 2.0), torch.ones_like(train))
    return {
        "train": train,
        "rollout": rollout,
        "mask": mask,
        "entropy": torch.rand(b, t, generator=gen),
        "advantages": torch.randn(b, generator=gen),
        "corrected": corrected,
        "weights": weights,
    }


def build_metrics() -> dict:
    return {
        "collection": MismatchDiagnostics(c=1.5),
        "entropy": TokenEntropy(),
        "masked": CorrectionFraction("masked"),
        "clipped": CorrectionFraction("clipped", c=2.0),
    }


def update(metrics: dict, shard: dict[str, torch.Tensor]) -> None:
    metrics["collection"].update(
        shard["train"],
        shard["rollout"],
        shard["mask"],
        advantages=shard["advantages"],
        entropy=shard["entropy"],
    )
    metrics["entropy"].update(shard["entropy"], shard["mask"])
    metrics["masked"].update(shard["mask"], shard["corrected"], shard["weights"])
    metrics["clipped"].update(shard["mask"], shard["corrected"], shard["weights"])


def compute(metrics: dict) -> dict[str, float]:
    out = {name: float(value) for name, value in metrics["collection"].compute().items()}
    for name in ("entropy", "masked", "clipped"):
        out[name] = float(metrics[name].compute())
    return out


def run(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world_size, port):
        results = {}
        for scenario in SCENARIOS:
            metrics = build_metrics()
            update(metrics, make_shard(scenario, rank))
            results[scenario] = compute(metrics)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
