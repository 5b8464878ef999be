"""The engine sync out of FSDP2 inside ``torch.inference_mode``, as Lightning's validation runs it on GPUs.

Lightning runs validation under ``torch.inference_mode`` unless the process group is gloo or the strategy is
FSDP1 (``lightning/pytorch/loops/utilities.py``, ``_no_grad_context``), so with ``trainer=fsdp_gpu`` (FSDP2
over NCCL) ``on_validation_start`` gathers the policy's DTensors and syncs the engines inside it. Gathering
there failed in ``get_model_state_dict`` ("Cannot set version_counter for inference tensor"). On CPU the
process group is gloo, where Lightning uses ``no_grad``: these tests enter ``inference_mode`` themselves, in
1 and 2 processes (and over NCCL on one GPU where there is one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.policy import Policy
from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
from tests.gloo import free_port, gloo_group

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [40]]
SAMPLING = SamplingConfig(n=2, max_new_tokens=6, seed=0)


def _sync_inside_inference_mode(device: torch.device) -> None:
    """Shard a policy with FSDP2, gather it and sync an engine inside ``inference_mode`` (GRPOModule's
    ``_full_state`` -> ``engine.sync_weights``); the gathered weights stay on the policy's device, and the engine
    then samples exactly as one built from the unsharded weights."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    reference = dict(build_tiny_qwen3(seed=0).state_dict())
    expected = TorchRolloutEngine(build_tiny_qwen3(seed=0).to(device), precision="fp32").generate(
        PROMPTS, SAMPLING
    )
    policy = Policy(build_tiny_qwen3(seed=0).to(device))
    for layer in policy.decoder_layers():
        fully_shard(layer)
    fully_shard(policy)
    assert isinstance(policy.model.model.layers[0].mlp.up_proj.weight, DTensor)
    engine = TorchRolloutEngine(build_tiny_qwen3(seed=1).to(device), precision="fp32")  # other weights
    with torch.inference_mode():  # Lightning's validation context over NCCL
        named = policy.full_state_dict(
            snapshot=False, device=None
        )  # what GRPOModule._full_state hands the engines
        engine.sync_weights(named)
        got = engine.generate(PROMPTS, SAMPLING)
        rank0 = policy.full_state_dict(rank0_only=True)
    state = dict(named)
    assert set(reference) <= set(state)
    for name, tensor in reference.items():
        assert not isinstance(state[name], DTensor) and not state[name].is_inference(), name
        assert state[name].device == device, name  # device-resident: no round trip through host memory
        assert torch.equal(state[name].cpu(), tensor), name
    assert (len(rank0) > 0) == (dist.get_rank() == 0)
    assert torch.equal(got.response_ids, expected.response_ids)
    torch.testing.assert_close(got.rollout_logprobs, expected.rollout_logprobs, rtol=0, atol=1e-6)
    # the policy still trains after the gather: a forward and backward outside inference mode
    batch = (got.prompt_ids, got.prompt_mask, got.response_ids, got.response_mask)
    out = policy.response_logprobs(*(t.clone() for t in batch))  # normal copies of inference tensors
    out.logprobs.sum().backward()


def _gloo_worker(rank: int, world_size: int, port: int) -> None:
    with gloo_group(rank, world_size, port):
        torch.set_num_threads(1)
        _sync_inside_inference_mode(torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_engine_sync_out_of_fsdp2_inside_inference_mode(monkeypatch, world_size):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))  # children unpickle _gloo_worker
    mp.spawn(_gloo_worker, args=(world_size, free_port()), nprocs=world_size, join=True)


def _nccl_worker(rank: int, port: int) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        _sync_inside_inference_mode(torch.device("cuda", 0))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_sync_out_of_fsdp2_inside_inference_mode_over_nccl(monkeypatch):
    """``trainer=fsdp_gpu trainer.devices=1``'s layout: FSDP2 over NCCL on one GPU."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    mp.spawn(_nccl_worker, args=(free_port(),), nprocs=1, join=True)
