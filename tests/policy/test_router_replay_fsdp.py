"""Rollout routing replay under FSDP2 (fully_shard per decoder layer, then the policy) with 2 CPU processes over gloo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ais_lightning.models import build_tiny_qwen3_moe
from ais_lightning.models.routing import routing_replay_mask
from ais_lightning.policy import Policy
from tests.gloo import free_port, gloo_group

WORLD_SIZE = 2


def _batch(rank: int):
    """One batch per rank, with its own recorded routing ``[B, P + T, L, k]`` (distinct experts per token)."""
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 11, 12, 13]])
    response_ids = torch.tensor([[14, 15, 0], [16, 3, 0], [17, 18, 19]]) + rank
    response_ids[0, 2] = response_ids[1, 2] = 0
    gen = torch.Generator().manual_seed(100 + rank)
    routing = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(3 * 7 * 4)]).view(3, 7, 4, 2)
    return (prompt_ids, prompt_ids != 0, response_ids, response_ids != 0), routing.to(torch.uint8)


def _unsharded(rank: int):
    """Log-probs of this rank's batch and gradients of the sum over both ranks' batches (FSDP averages them)."""
    policy = Policy(build_tiny_qwen3_moe(seed=0), router_replay=True)
    total, mine = 0.0, None
    for r in range(WORLD_SIZE):
        rows, routing = _batch(r)
        lp = policy.response_logprobs(*rows, routing=routing).logprobs  # [B, T]
        total = total + lp.sum()
        if r == rank:
            mine = lp.detach()
    (total / WORLD_SIZE).backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters()}
    return mine, grads


def _worker(rank: int, port: int) -> None:
    with gloo_group(rank, WORLD_SIZE, port):
        torch.set_num_threads(1)
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        ref_lp, ref_grads = _unsharded(rank)
        policy = Policy(build_tiny_qwen3_moe(seed=0), router_replay=True)
        for layer in policy.decoder_layers():  # as GRPOModule.configure_model shards it
            fully_shard(layer)
        fully_shard(policy)
        assert isinstance(policy.model.model.layers[0].mlp.gate.weight, DTensor)
        rows, routing = _batch(rank)
        lp = policy.response_logprobs(*rows, routing=routing).logprobs
        _, used = policy.routing_replay.last_routing()
        mask = routing_replay_mask(rows[1], rows[3])
        assert torch.equal(used[mask], routing.long()[mask])  # every replayed token and layer, on every rank
        torch.testing.assert_close(lp.detach(), ref_lp, rtol=0, atol=1e-5)
        lp.sum().backward()
        for name, p in policy.model.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        dist.barrier()


@pytest.mark.slow
def test_router_replay_under_fsdp2(monkeypatch):
    # spawned children unpickle ``_worker`` by its module name (importlib mode): the repository root on sys.path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD_SIZE, join=True)
