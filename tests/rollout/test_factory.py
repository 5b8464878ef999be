"""Engine factory: names, precisions, missing packages, lazy vLLM registration."""

import sys
import types

import pytest
import torch

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.rollout import (
    TorchRolloutEngine,
    build_engine,
    engine_precisions,
    factory,
    validate_engine_config,
)


def test_unknown_engine_raises():
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'"):
        validate_engine_config("sglang", "fp32")


@pytest.mark.parametrize("name, precision", [("torch", "fp16"), ("torch", "nvfp4"), ("te", "fp4")])
def test_unknown_precision_raises(name, precision):
    with pytest.raises(ValueError, match=f"does not support precision '{precision}'"):
        validate_engine_config(name, precision)


def test_torch_engine_options_are_validated():
    validate_engine_config("torch", "int8", backend="emulate", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        validate_engine_config("torch", "fp32", kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="backend"):
        validate_engine_config("torch", "bf16", backend="emulate")


def test_missing_vllm_says_what_to_install(monkeypatch):
    monkeypatch.setattr(factory, "_has_package", lambda name: name != "vllm")
    with pytest.raises(ValueError, match=r"pip install 'ais-lightning\[vllm"):
        validate_engine_config("vllm", "bf16")


def test_missing_transformer_engine_says_what_to_install(monkeypatch):
    monkeypatch.setattr(factory, "_has_package", lambda name: name != "transformer_engine")
    with pytest.raises(ValueError, match=r"pip install 'ais-lightning\[te\]'"):
        validate_engine_config("te", "fp8")


def test_te_without_cuda_raises(monkeypatch):
    monkeypatch.setattr(factory, "_has_package", lambda name: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA"):
        validate_engine_config("te", "fp8")


def test_build_torch_engine():
    engine = build_engine("torch", build_tiny_qwen3(seed=0), precision="int8", backend="emulate")
    assert isinstance(engine, TorchRolloutEngine)
    assert (engine.precision, engine.backend) == ("int8", "emulate")


def test_vllm_is_built_by_lazy_import(monkeypatch):
    """build_engine('vllm') imports ais_lightning.rollout.vllm_engine only when asked, and uses its class."""

    class FakeVLLMEngine:
        def __init__(self, model, **kwargs):
            self.model, self.kwargs = model, kwargs

    fake = types.ModuleType("ais_lightning.rollout.vllm_engine")
    fake.VLLMRolloutEngine = FakeVLLMEngine
    fake.PRECISIONS = ("bf16",)
    monkeypatch.setitem(sys.modules, "ais_lightning.rollout.vllm_engine", fake)
    monkeypatch.setattr(factory, "_has_package", lambda name: True)
    assert engine_precisions("vllm") == ("bf16",)
    engine = build_engine("vllm", "a-model", precision="bf16", seed=3)
    assert isinstance(engine, FakeVLLMEngine)
    assert engine.kwargs == {"precision": "bf16", "seed": 3}
    with pytest.raises(ValueError, match="precision 'fp8'"):
        build_engine("vllm", "a-model", precision="fp8")
