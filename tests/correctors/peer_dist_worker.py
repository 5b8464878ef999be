"""Worker of the 2-process gloo test of the batch-statistics correctors (imported by name when spawned).

Not a test module: ``test_peer_distributed.py`` puts this directory on ``sys.path`` so that
``torch.multiprocessing.spawn`` can pickle ``run`` by reference.
"""

from __future__ import annotations

import torch

from ais_lightning.correctors import M2PO, PSIS, BatchNormalizedTIS, DivergenceRejection
from tests.gloo import gloo_group

SCENARIOS = ("uneven", "one_rank_empty")
LENGTH = 16
ROWS = (20, 12)
"""Rank 0 holds rows 0..19 of the global batch, rank 1 rows 20..31."""


def build() -> dict:
    """The correctors that use statistics of the whole batch."""
    return {
        "tis_bn_token": BatchNormalizedTIS(c_high=2.0),
        "tis_bn_seq": BatchNormalizedTIS(level="sequence", c_high=3.0),
        "rs_tis_bn": DivergenceRejection(token_k1=3.0, tis_level="token", tis_batch_normalize=True),
        "m2po": M2PO(tau=0.04),
        "m2po_loose": M2PO(tau=0.3, c_high=4.0),
        "psis": PSIS(max_tail=40),  # M = 62 for the global batch: capped at 40
        "psis_seq": PSIS(level="geometric"),
    }


def make_shard(scenario: str, rank: int) -> dict[str, torch.Tensor]:
    """Deterministic data of one rank; the ranks see very different mismatch."""
    b = ROWS[rank]
    gen = torch.Generator().manual_seed(100 * SCENARIOS.index(scenario) + rank)
    rollout = -torch.rand(b, LENGTH, generator=gen) * 3.0 - 0.05  # [B, T]
    scale = 0.9 if rank == 1 else 0.15
    noise = torch.randn(b, LENGTH, generator=gen)
    train = rollout + scale * noise + 0.6 * (noise > 1.5).float() * noise.abs()  # a heavier right tail
    mask = torch.rand(b, LENGTH, generator=gen) < 0.85  # [B, T]
    if scenario == "one_rank_empty" and rank == 1:
        mask = torch.zeros_like(mask)
    return {
        "train_logprobs": train,
        "rollout_logprobs": rollout,
        "mask": mask,
        "advantages": torch.randn(b, generator=gen),
    }


def global_batch(scenario: str) -> dict[str, torch.Tensor]:
    shards = [make_shard(scenario, rank) for rank in range(2)]
    return {key: torch.cat([s[key] for s in shards]) for key in shards[0]}


def run_all(data: dict[str, torch.Tensor]) -> dict:
    return {name: corrector(**data) for name, corrector in build().items()}


def run(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world_size, port):
        results = {}
        for scenario in SCENARIOS:
            outs = run_all(make_shard(scenario, rank))
            results[scenario] = {
                n: {"weights": o.weights, "mask": o.mask, "stats": o.stats} for n, o in outs.items()
            }
        torch.save(results, f"{out_dir}/rank{rank}.pt")
