"""The engine registry: names, precisions, missing packages, no import of vLLM or Transformer Engine."""

import subprocess
import sys

import pytest
import torch

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.rollout import (
    ENGINES,
    TERolloutEngine,
    TorchRolloutEngine,
    build_engine,
    engine_args,
    engine_class,
    engine_precisions,
    validate_engine_config,
)
from tests.gpu.fake_cuda import fake_cuda


def test_unknown_engine_raises():
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'"):
        validate_engine_config("sglang", "fp32")


@pytest.mark.parametrize("name, precision", [("torch", "fp6"), ("torch", "nvfp4"), ("te", "fp4")])
def test_unknown_precision_raises(name, precision):
    with pytest.raises(
        ValueError, match=f"^precision='{precision}' is not supported by .*; precision must be one of"
    ):
        validate_engine_config(name, precision)


def test_engine_classes_and_precisions_come_from_the_classes():
    assert engine_class("torch") is TorchRolloutEngine
    assert engine_class("te") is TERolloutEngine
    assert engine_precisions("torch")[:5] == ("fp32", "bf16", "fp8", "fp4", "int8")
    assert {"int4", "int4_w", "int2_ocs"} <= set(engine_precisions("torch"))  # Bit-by-Bit recipes
    assert engine_precisions("te") == ("fp8",)
    assert engine_precisions("vllm") == ("fp32", "bf16", "fp8")
    with pytest.raises(ValueError, match="unknown rollout engine"):
        engine_precisions("sglang")


def test_torch_engine_options_are_validated():
    args = validate_engine_config("torch", "int8", backend="emulate", kv_cache_dtype="fp8")
    assert (args["precision"], args["backend"], args["kv_cache_dtype"]) == ("int8", "emulate", "fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4'.*one of \\[None, 'auto', 'fp8'\\]"):
        validate_engine_config("torch", "fp32", kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="backend"):
        validate_engine_config("torch", "bf16", backend="emulate")
    with pytest.raises(ValueError, match="unknown argument.*'gpu_memory_utilization'.*accepts"):
        validate_engine_config(
            "torch", "fp32", gpu_memory_utilization=0.5
        )  # a vLLM option on the torch engine


def test_missing_vllm_says_what_to_install(monkeypatch):
    monkeypatch.setattr(engine_args, "has_package", lambda name: name != "vllm")
    with pytest.raises(ValueError, match=r"pip install 'ais-lightning\[vllm"):
        validate_engine_config("vllm", "bf16")


def test_missing_transformer_engine_says_what_to_install(monkeypatch):
    monkeypatch.setattr(engine_args, "has_package", lambda name: name != "transformer_engine")
    fake_cuda(monkeypatch, capability=(9, 0))
    with pytest.raises(ValueError, match=r"pip install --no-build-isolation 'ais-lightning\[te\]'"):
        validate_engine_config("te", "fp8")


def test_te_without_cuda_raises(monkeypatch):
    monkeypatch.setattr(engine_args, "has_package", lambda name: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA GPU.*engine 'torch'"):
        validate_engine_config("te", "fp8")


def test_build_torch_engine():
    engine = build_engine("torch", build_tiny_qwen3(seed=0), precision="int8", backend="emulate")
    assert isinstance(engine, TorchRolloutEngine)
    assert (engine.precision, engine.backend) == ("int8", "emulate")


def test_build_engine_uses_the_registered_class_and_its_check_args(monkeypatch):
    """build_engine('vllm') builds the class ENGINES registers under that name, checked by its own check_args."""
    checked = []

    class FakeVLLMEngine:
        PRECISIONS = ("bf16",)

        @classmethod
        def check_args(cls, **kwargs):
            checked.append(kwargs)
            if kwargs.get("precision", "bf16") not in cls.PRECISIONS:
                raise ValueError(f"precision {kwargs['precision']!r}")
            return kwargs

        def __init__(self, model, **kwargs):
            self.model, self.kwargs = model, kwargs

    monkeypatch.setitem(ENGINES, "vllm", FakeVLLMEngine)
    assert engine_precisions("vllm") == ("bf16",)
    engine = build_engine("vllm", "a-model", precision="bf16", seed=3)
    assert isinstance(engine, FakeVLLMEngine)
    assert engine.kwargs == {"precision": "bf16", "seed": 3}
    assert checked == [{"precision": "bf16", "seed": 3}]  # validated by the class's own check_args
    with pytest.raises(ValueError, match="precision 'fp8'"):
        build_engine("vllm", "a-model", precision="fp8")


def test_importing_the_package_imports_no_heavy_engine_package():
    """``import ais_lightning.rollout`` (every engine class, the registry) imports neither vllm nor
    transformer_engine; each engine imports its package only when it is constructed."""
    code = """
import sys
import ais_lightning.rollout as rollout
heavy = ("vllm", "transformer_engine")
assert not [m for m in sys.modules if m.split(".")[0] in heavy], "heavy package imported"
from ais_lightning.rollout import ENGINES, VLLMRolloutEngine
import ais_lightning.rollout.vllm_engine as vllm_engine
assert VLLMRolloutEngine is vllm_engine.VLLMRolloutEngine is ENGINES["vllm"]
assert VLLMRolloutEngine.PRECISIONS == ("fp32", "bf16", "fp8")
assert "VLLMRolloutEngine" in rollout.__all__
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
