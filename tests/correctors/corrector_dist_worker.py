"""Worker of the 2-process gloo test of AIS v2 and v1 (imported by name in the spawned processes).

Not a test module: ``test_distributed.py`` puts this directory on ``sys.path`` so that
``torch.multiprocessing.spawn`` can pickle ``run`` by reference.
"""

from __future__ import annotations

import torch

from ais_lightning.correctors import AIS, AISv1
from tests.gloo import gloo_group

SCENARIOS = ("uneven", "one_rank_empty")
CORRECTORS = {
    "ais": (AIS, dict(c=1.5, noise_to_signal=0.5, momentum=0.5, ema_decay=0.5)),
    "ais_default": (AIS, {}),
    "ais_mis": (AIS, dict(base="mis", c=1.5, c_low=0.6)),
    "ais_entropy_bound": (AIS, dict(spread="entropy_bound")),
    "ais_v1": (AISv1, dict(c=1.5, kappa=0.5, alpha=1.5, beta=0.7, ema_decay=0.5)),
}
"""Name -> (class, kwargs) of every corrector the test runs on both ranks."""
LENGTH = 6


def make_shard(scenario: str, rank: int, step: int) -> dict[str, torch.Tensor]:
    """Deterministic data of one rank at one step; the ranks hold different batch sizes."""
    b = 4 if rank == 0 else 2
    gen = torch.Generator().manual_seed(1000 * SCENARIOS.index(scenario) + 10 * step + rank)
    rollout = -torch.rand(b, LENGTH, generator=gen) * 3.0 - 0.05  # [B, T]
    scale = 1.0 if rank == 1 else 0.1  # the ranks see very different mismatch
    train = rollout + scale * torch.randn(b, LENGTH, generator=gen)  # [B, T]
    mask = torch.rand(b, LENGTH, generator=gen) < 0.8  # [B, T]
    if scenario == "one_rank_empty" and rank == 1:
        mask = torch.zeros_like(mask)
    return {
        "train_logprobs": train,
        "rollout_logprobs": rollout,
        "mask": mask,
        "advantages": torch.randn(b, generator=gen),
        "entropy": torch.rand(b, LENGTH, generator=gen) * 2.0,
        "impurity": torch.rand(b, LENGTH, generator=gen)
        * 0.8,  # below its bound 1 - exp(-H) or not: any [0, 1)
    }


def run_steps(name: str, shards_of_step) -> list[dict]:
    """Two steps of corrector ``name`` (the second goes through the EMA); weights and stats per step."""
    cls, kwargs = CORRECTORS[name]
    corrector = cls(**kwargs)
    results = []
    for step in range(2):
        out = corrector(**shards_of_step(step))
        results.append({"weights": out.weights, "stats": out.stats})
    return results


def run(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world_size, port):
        results = {
            (name, scenario): run_steps(name, lambda step, s=scenario: make_shard(s, rank, step))
            for name in CORRECTORS
            for scenario in SCENARIOS
        }
        torch.save(results, f"{out_dir}/rank{rank}.pt")
