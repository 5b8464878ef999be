"""DiffusionPolicy under FSDP2 (fully_shard per block, then the model and/or the policy): 2 CPU processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.gloo import free_port, gloo_group

WORLD_SIZE = 2


def _batch():
    from ais_lightning.policy import tiny_diffusion_policy
    from ais_lightning.rollout.base import SamplingConfig

    policy = tiny_diffusion_policy(seed=0)
    engine = policy.build_engine("fp32", block_length=3)
    sampling = SamplingConfig(n=2, max_new_tokens=6, stop_token_ids=list(range(30, 40)), seed=1)
    return engine.generate([[20, 21, 14, 22, 32], [24, 14, 25, 32]], sampling)


def _losses(policy, batch):
    from ais_lightning.modules.sft import encode_pairs

    out = policy.batch_logprobs(batch, temperature=0.7, compute_entropy=True)
    pairs = encode_pairs(policy.tokenizer, ["12+34=", "5+6="], ["46", "11"])
    sft = policy.sft_loss(*pairs, generator=torch.Generator().manual_seed(0))
    return out.logprobs, out.entropy, sft


def _reference(batch):
    from ais_lightning.policy import tiny_diffusion_policy

    policy = tiny_diffusion_policy(seed=0, logprob_chunk_size=4)
    lp, ent, sft = _losses(policy, batch)
    (lp.sum() + ent.sum() + sft).backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters()}
    return dict(policy.full_state_dict()), lp.detach(), ent.detach(), sft.detach(), grads


def _check_sharded(root: str, batch, reference) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ais_lightning.policy import tiny_diffusion_policy

    ref_state, ref_lp, ref_ent, ref_sft, ref_grads = reference
    policy = tiny_diffusion_policy(seed=0, logprob_chunk_size=4)
    model = policy.model
    for layer in policy.decoder_layers():
        fully_shard(layer)
    if root in ("model", "both"):
        fully_shard(model)
    if root in ("policy", "both"):
        fully_shard(policy)
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)

    named = policy.full_state_dict()
    assert [n for n, _ in named] == list(ref_state), root
    assert all(torch.equal(t, ref_state[n]) for n, t in named), root
    fresh = policy.fresh_model()
    assert not any(isinstance(p, DTensor) for p in fresh.parameters())

    lp, ent, sft = _losses(policy, batch)
    torch.testing.assert_close(lp.detach(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.detach(), ref_ent, rtol=0, atol=1e-5)
    torch.testing.assert_close(sft.detach(), ref_sft, rtol=0, atol=1e-5)
    (lp.sum() + ent.sum() + sft).backward()
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{root}: {name}")


def _worker(rank: int, port: int) -> None:
    with gloo_group(rank, WORLD_SIZE, port):
        torch.set_num_threads(1)
        batch = _batch()
        reference = _reference(batch)
        _check_sharded("model", batch, reference)  # fully_shard(policy.model) as the root
        _check_sharded("policy", batch, reference)  # fully_shard(policy) as the root (the GRPO module's way)
        _check_sharded("both", batch, reference)  # policy.model a non-root FSDP module


@pytest.mark.slow
def test_diffusion_policy_under_fsdp2(monkeypatch):
    # Spawned children unpickle ``_worker`` by this module's name: they need the repository root on sys.path.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD_SIZE, join=True)
