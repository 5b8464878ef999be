"""Transformer Engine rollouts: a clear error on CPU; an FP8 smoke test where CUDA and TE exist."""

import importlib.util

import pytest
import torch

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.rollout import SamplingConfig, TERolloutEngine

HAS_CUDA = torch.cuda.is_available()
HAS_TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA error")
def test_without_cuda_construction_raises_clear_error():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*TorchRolloutEngine"):
        TERolloutEngine(build_tiny_qwen3(seed=0))


def test_bad_options_raise_before_touching_the_device():
    model = build_tiny_qwen3(seed=0)
    with pytest.raises(ValueError, match="precision"):
        TERolloutEngine(model, precision="fp4")
    with pytest.raises(ValueError, match="fp8_format"):
        TERolloutEngine(model, fp8_format="E5M2")


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TE), reason="needs CUDA and transformer_engine")
def test_fp8_rollout_is_close_to_fp32_policy():
    from ais_lightning.policy import Policy

    model = build_tiny_qwen3(seed=0).eval()
    engine = TERolloutEngine(model)
    assert engine.num_te_linears == 4 * 7  # q, k, v, o, gate, up, down per layer; lm_head kept
    batch = engine.generate([[5, 6, 7], [8, 9, 10, 11, 12]], SamplingConfig(n=3, max_new_tokens=8, seed=0))
    with torch.no_grad():
        pi = (
            Policy(model)
            .response_logprobs(
                batch.prompt_ids.cpu(),
                batch.prompt_mask.cpu(),
                batch.response_ids.cpu(),
                batch.response_mask.cpu(),
            )
            .logprobs
        )
    delta = (pi - batch.rollout_logprobs.cpu())[batch.response_mask.cpu()]
    assert torch.isfinite(delta).all()
    assert 0 < delta.abs().max().item() < 0.5
