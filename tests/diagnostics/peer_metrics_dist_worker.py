"""Worker of the 2-process gloo sync test of the verl / TRL / NeMo-RL / prime-rl metrics and PSIS k-hat.

Not a test module: ``test_peer_metrics_distributed.py`` puts this directory on ``sys.path`` so that
``torch.multiprocessing.spawn`` can pickle ``run`` by reference.
"""

from __future__ import annotations

import torch

from ais_lightning.diagnostics import MismatchDiagnostics, PSISKHat
from tests.gloo import gloo_group

SCENARIOS = ("uneven", "one_rank_empty")


def make_shard(scenario: str, rank: int) -> dict:
    """Deterministic data of one rank; shards differ in batch size, length, tail weight and task mix."""
    b, t = (20, 12) if rank == 0 else (14, 9)
    gen = torch.Generator().manual_seed(100 * SCENARIOS.index(scenario) + rank)
    rollout = -torch.rand(b, t, generator=gen) * 3.0 - 3.0  # [B, T]
    tail = -torch.log(torch.rand(b, t, generator=gen)) * (0.9 if rank == 1 else 0.3)  # Pareto log-weights
    train = rollout + tail - 0.5  # [B, T]
    mask = torch.rand(b, t, generator=gen) < 0.8  # [B, T]
    if rank == 1:  # a response far below mu: the largest log_ppl_diff and smallest mean ratio sit on rank 1
        train[0] = rollout[0] - 3.0
        mask[0] = True
        train[1] = rollout[1]  # a response where pi = mu: the smallest seq_mult_prob_error (1) sits on rank 1
        mask[1, 0] = True
    if scenario == "one_rank_empty" and rank == 1:
        mask = torch.zeros_like(mask)
    # the per-task metrics: rank 0 alternates tasks a / b, rank 1 is mostly a
    tasks = [("a", "b")[i % 2] if rank == 0 else ("b" if i % 3 == 0 else "a") for i in range(b)]
    return {"train": train, "rollout": rollout, "mask": mask, "tasks": tasks}


def build_metrics() -> dict:
    # max_tail = 16: the global top-17 spans both ranks, so merge_top is exercised.
    return {"collection": MismatchDiagnostics(c=1.5, tasks=("a", "b")), "khat16": PSISKHat(max_tail=16)}


def update(metrics: dict, shard: dict) -> None:
    metrics["collection"].update(shard["train"], shard["rollout"], shard["mask"], tasks=shard["tasks"])
    metrics["khat16"].update(shard["train"], shard["rollout"], shard["mask"])


def compute(metrics: dict) -> dict[str, float]:
    out = {name: float(value) for name, value in metrics["collection"].compute().items()}
    out["khat16"] = float(metrics["khat16"].compute())
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
