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
    with pytest.raises(ValueError, match="needs a CUDA GPU.*TorchRolloutEngine"):
        TERolloutEngine(build_tiny_qwen3(seed=0))
    with pytest.raises(ValueError, match="needs a CUDA GPU"):  # the same check, with no model
        TERolloutEngine.check_args()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "fp4"}, "^precision='fp4'.*one of \\['fp8'\\]"),
        ({"fp8_format": "E5M2"}, "^fp8_format='E5M2'.*one of \\['E4M3', 'HYBRID'\\]"),
        ({"amax_history_len": 0}, "^amax_history_len"),
        ({"margin": -1}, "^margin"),
        ({"params_dtype": "int8"}, "^params_dtype"),
        ({"device": "cpu"}, "^device must be a CUDA device"),
        ({"kv_cache_dtype": "int4"}, "^kv_cache_dtype"),
        ({"compact_below": 1.5}, "^compact_below"),
    ],
)
def test_bad_options_raise_before_touching_the_device(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TERolloutEngine.check_args(**kwargs)
    with pytest.raises(ValueError, match=match):  # the constructor runs the same check first
        TERolloutEngine(build_tiny_qwen3(seed=0), **kwargs)


def test_config_time_check_rejects_options_of_other_engines():
    with pytest.raises(ValueError, match="unknown argument.*'backend'.*accepts.*'fp8_format'"):
        TERolloutEngine.check_args(backend="int8")


def test_check_args_fills_the_constructor_defaults(monkeypatch):
    from ais_lightning.rollout import engine_args

    monkeypatch.setattr(engine_args, "has_package", lambda name: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = TERolloutEngine.check_args(params_dtype="float16", kv_cache_dtype="auto")
    assert args == {
        "precision": "fp8",
        "kv_cache_dtype": None,
        "fp8_format": "E4M3",
        "amax_history_len": 16,
        "margin": 0,
        "params_dtype": torch.float16,
        "device": "cuda",
        "pad_token_id": None,
        "compact_below": 0.5,
    }


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
