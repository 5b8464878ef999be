"""Policy.full_state_dict under FSDP1 (FullyShardedDataParallel), 2 CPU processes over gloo.

FSDP1 runs on CPU when it is given ``device_id=torch.device("cpu")`` (its device handle is then
``torch.cpu``; Lightning's FSDPStrategy passes it the same way but refuses a CPU accelerator). This is the
layout Lightning's FSDPStrategy builds: the LightningModule is the root, the decoder layers are wrapped
units, the embedding, final norm and head belong to the root's flat parameter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.policy import Policy
from tests.gloo import free_port, gloo_group

WORLD_SIZE = 2


class _Root(nn.Module):
    """Stands in for the LightningModule that Lightning's FSDPStrategy wraps as the FSDP1 root."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy
        self.other = nn.Linear(3, 3)  # state of the module that is not the policy's

    def forward(self, *batch):
        return self.policy(*batch)


def _batch():
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    response_ids = torch.tensor([[14, 15], [16, 0]])
    return prompt_ids, prompt_ids != 0, response_ids, response_ids != 0


def _worker(rank: int, port: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with gloo_group(rank, WORLD_SIZE, port):
        torch.set_num_threads(1)
        reference = dict(Policy(build_tiny_qwen3(seed=0)).full_state_dict())
        ref_lp = Policy(build_tiny_qwen3(seed=0))(*_batch())[0].detach()
        policy = Policy(build_tiny_qwen3(seed=0))
        layer = type(policy.decoder_layers()[0])
        root = FSDP(
            _Root(policy),
            auto_wrap_policy=ModuleWrapPolicy({layer}),
            device_id=torch.device("cpu"),
            use_orig_params=True,  # as Lightning's FSDPStrategy
        )
        # Before the root's first forward (Lightning: on_train_start / on_validation_start).
        with pytest.raises(ValueError, match="fsdp_root is required.*FSDP1"):
            policy.full_state_dict()
        named = policy.full_state_dict(fsdp_root=root)
        assert [n for n, _ in named] == list(reference)  # no "other.*", no wrapper prefixes
        for name, tensor in named:
            assert tensor.shape == reference[name].shape, name  # not flat 1-D shards
            assert torch.equal(tensor, reference[name]), name
        with pytest.raises(ValueError, match="outermost FullyShardedDataParallel"):
            policy.full_state_dict(fsdp_root=policy.model)
        # rank0_only (FSDP1's offload_to_cpu + rank0_only) is not run here: on a CPU-only FSDP1 it
        # crashes the process (SIGSEGV in torch 2.13), a path no GPU run takes.
        # The root's first forward still works: no wrapped layer was initialised as a root.
        lp, _, _ = root(*_batch())
        torch.testing.assert_close(lp.detach(), ref_lp, rtol=0, atol=1e-5)
        again = dict(policy.full_state_dict(fsdp_root=root))  # and after it
        assert all(torch.equal(again[n], reference[n]) for n in reference)


@pytest.mark.slow
def test_full_state_dict_under_fsdp1_comes_from_the_root(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD_SIZE, join=True)
