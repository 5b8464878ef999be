"""Policy under FSDP2 (fully_shard) with 2 CPU processes over gloo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.policy import Policy, load_named_tensors
from tests.gloo import free_port, gloo_group

WORLD_SIZE = 2


def _batch():
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 11, 12, 13]])
    response_ids = torch.tensor([[14, 15, 0], [16, 0, 0], [17, 18, 19]])
    return prompt_ids, prompt_ids != 0, response_ids, response_ids != 0


def _reference():
    """Unsharded weights, log-probs, entropies and gradients of the same loss."""
    model = build_tiny_qwen3(seed=0)
    policy = Policy(model)
    out = policy.response_logprobs(*_batch(), temperature=0.7, compute_entropy=True, chunk_size=2)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return dict(policy.full_state_dict()), out.logprobs.detach(), out.entropy.detach(), grads


def _check_sharded(root: str, reference) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    ref_state, ref_lp, ref_ent, ref_grads = reference
    model = build_tiny_qwen3(seed=0)
    policy = Policy(model)
    for layer in policy.decoder_layers():
        fully_shard(layer)
    if root in ("model", "both"):
        fully_shard(model)
    if root in ("policy", "both"):
        fully_shard(policy)
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)

    named = policy.full_state_dict()
    assert [n for n, _ in named] == list(ref_state), root
    for name, tensor in named:
        assert not isinstance(tensor, DTensor) and tensor.device.type == "cpu"
        assert torch.equal(tensor, ref_state[name]), (root, name)
    fresh = policy.fresh_model()  # unsharded, plain tensors, loads the gathered weights
    assert not any(isinstance(p, DTensor) for p in fresh.parameters())
    load_named_tensors(fresh, named)
    assert all(torch.equal(t, ref_state[n]) for n, t in fresh.state_dict().items())
    rank0 = policy.full_state_dict(rank0_only=True)
    if dist.get_rank() == 0:
        assert [n for n, _ in rank0] == list(ref_state)
        assert all(torch.equal(t, ref_state[n]) for n, t in rank0)
    else:
        assert rank0 == []

    # Same batch on both ranks: FSDP averages identical gradients, so they equal the unsharded ones.
    out = policy.response_logprobs(*_batch(), temperature=0.7, compute_entropy=True, chunk_size=2)
    torch.testing.assert_close(out.logprobs.detach(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy.detach(), ref_ent, rtol=0, atol=1e-5)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{root}: {name}")


def _worker(rank: int, port: int) -> None:
    with gloo_group(rank, WORLD_SIZE, port):
        torch.set_num_threads(1)
        reference = _reference()
        _check_sharded("model", reference)  # fully_shard(policy.model) as the root
        _check_sharded("policy", reference)  # fully_shard(policy) as the root, policy.model unwrapped
        _check_sharded("both", reference)  # policy.model a non-root FSDP module (resharded after forward)


@pytest.mark.slow
def test_full_state_dict_and_logprobs_under_fsdp2(monkeypatch):
    # pytest imports this file as ``tests.policy.test_fsdp`` (importlib mode); spawned children
    # unpickle ``_worker`` by that name, so they need the repository root on sys.path.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD_SIZE, join=True)
