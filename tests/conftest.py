"""Fixtures shared by test modules in several folders."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tiny matmuls (no barrier stalls when the cores are shared), restored
    afterwards. Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The built-in tiny Qwen3 and its character tokenizer saved as a local Hugging Face model directory (what
    ``policy=local policy.path=...`` reads), once per session."""
    from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3, save_tiny_model

    return save_tiny_model(
        build_tiny_qwen3(seed=0), build_char_tokenizer(), tmp_path_factory.mktemp("tiny_model")
    )


@pytest.fixture(params=["vnni", "avx2"])
def int8_isa(request, monkeypatch):
    """Run the test as on a CPU with AVX512-VNNI and as on one with AVX2 only: the probe of the CPU's int8 kernels
    (``ais_lightning.quant.cpu_int8.cpu_int8_isa``, which picks the default int8 backend) forced through
    ``AIS_LIGHTNING_INT8_ISA``. Every backend computes the same numbers on any x86 CPU (only their speed depends on
    it), so both cases run here whatever this CPU is; ``avx2`` needs fbgemm (an x86 CPU)."""
    from ais_lightning.quant.cpu_int8 import INT8_ISA_ENV, fbgemm_available

    if request.param == "avx2" and not fbgemm_available():
        pytest.skip("fbgemm's kernels need an x86 CPU with AVX2")
    monkeypatch.setenv(INT8_ISA_ENV, request.param)
    return request.param
