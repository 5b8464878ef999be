"""Engines compute in their own precision under a caller's autocast.

Lightning's precision plugin (``precision=bf16-mixed``) wraps ``training_step`` / ``validation_step`` in
``torch.autocast``, and the GRPO module calls ``engine.generate`` and ``engine.sync_weights`` from there: an
fp32 engine must still compute in fp32 (its log-probs are mu, and the trainer-precision copy's are the
reference), so every engine turns autocast off inside ``generate`` and ``sync_weights``.
"""

from __future__ import annotations

import pytest
import torch

from ais_lightning.models import build_tiny_diffusion, build_tiny_qwen3
from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
from ais_lightning.rollout.diffusion_engine import DiffusionRolloutEngine

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [40]]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _same_batch(a, b) -> None:
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_torch_engine_ignores_a_callers_bf16_autocast(precision):
    """Same seed, same prompts: the log-probs under ``torch.autocast("cpu", bfloat16)`` are those outside it,
    bit for bit (under autocast every linear and attention ran in bf16: |delta log p| ~1e-2)."""
    model = build_tiny_qwen3(seed=0, initializer_range=0.15)
    weights = list(build_tiny_qwen3(seed=1, initializer_range=0.15).state_dict().items())
    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=3)
    plain = TorchRolloutEngine(model, precision=precision)
    plain.generate(PROMPTS, sampling)  # calibrates (fp8: outlier channels), as a first rollout would
    plain.sync_weights(weights)
    outside = plain.generate(PROMPTS, sampling)
    mixed = TorchRolloutEngine(model, precision=precision)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what Lightning's bf16-mixed puts around the steps
        mixed.generate(PROMPTS, sampling)
        mixed.sync_weights(weights)  # re-quantizes (fp8) inside the caller's autocast
        inside = mixed.generate(PROMPTS, sampling)
        assert torch.is_autocast_enabled("cpu")  # the caller's autocast is back after the engine returns
    assert outside.rollout_logprobs.dtype == torch.float32
    _same_batch(outside, inside)


def test_diffusion_engine_ignores_a_callers_bf16_autocast():
    engine = DiffusionRolloutEngine(build_tiny_diffusion(seed=0))
    sampling = SamplingConfig(n=2, max_new_tokens=6, stop_token_ids=[2], seed=5)
    outside = engine.generate(PROMPTS, sampling)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = engine.generate(PROMPTS, sampling)
    _same_batch(outside, inside)


def test_vllm_engine_runs_vllm_outside_a_callers_autocast(monkeypatch, tmp_path):
    """vLLM's in-process engine core runs its forward in the calling thread (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    where a caller's autocast would apply: generate and sync reach the stand-in vLLM with autocast off."""
    from ais_lightning.rollout.vllm_engine import VLLMRolloutEngine
    from tests.rollout.vllm_stand_in import stand_in_vllm

    build_tiny_qwen3(seed=0).save_pretrained(tmp_path)
    vllm = stand_in_vllm(monkeypatch)
    engine = VLLMRolloutEngine(str(tmp_path), precision="fp32")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.sync_weights(build_tiny_qwen3(seed=0).state_dict().items())
        engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=4, seed=0))
    assert vllm.autocast_seen == {"collective_rpc": False, "reset_prefix_cache": False, "generate": False}
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_engine_ignores_a_callers_bf16_autocast_on_gpu():
    """Lightning's ``bf16-mixed`` on a GPU is ``torch.autocast("cuda", bfloat16)``: the fp32 engine's log-probs
    stay those it computes outside it."""
    engine = TorchRolloutEngine(build_tiny_qwen3(seed=0, initializer_range=0.15).cuda(), precision="fp32")
    sampling = SamplingConfig(n=2, max_new_tokens=8, seed=3)
    outside = engine.generate(PROMPTS, sampling)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        inside = engine.generate(PROMPTS, sampling)
    assert torch.equal(outside.response_ids, inside.response_ids)
    torch.testing.assert_close(outside.rollout_logprobs, inside.rollout_logprobs, rtol=0, atol=1e-6)
