"""The fp8_gemm backend (torch._scaled_mm): operand layouts and numerics built on CPU tensors, the device
requirements, the engine's config-time check, and the real GEMM where a GPU has it.

The blockwise layout rules mirrored here are those of torch's ``aten/src/ATen/native/cuda/ScaledBlas.cpp``
for ``torch.nn.functional.scaled_mm`` (``_scaled_block1x128_block128x128``): activation scales
``[M, ceil(K/128)]`` outer-dim-major (strides ``(1, M)``), weight scales of ``mat2 = W.t()`` as
``[L4, ceil(N/128)]`` with strides ``(1, L4)``, where L4 = ceil(K/128) rounded up to a multiple of 4: cuBLASLt
gets only the scale tensor's data pointer and reads it with that leading dimension (PyTorch PR 166752; the
legacy ``torch._scaled_mm`` accepts the unpadded layout and gives silently wrong products when
ceil(K/128) % 4 != 0). torch's CPU kernels have no blockwise GEMM, so the values are checked against a
pure-torch emulation of what cuBLASLt reads instead (``ais_lightning.toolkit.stand_ins.cublaslt_gemm``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from ais_lightning.app.build import validate
from ais_lightning.app.config import CONFIG_DIR, register_configs
from ais_lightning.quant import QuantLinear, fake_quantize, quantize
from ais_lightning.quant.linear import (
    blockwise_activation_operands,
    blockwise_weight_operands,
    fp8_gemm_requirement,
    scaled_mm_linear,
)
from ais_lightning.rollout import TorchRolloutEngine
from ais_lightning.toolkit.stand_ins.cublaslt_gemm import (
    EmulatedBlockwiseGemm,
    cublaslt_weight_scales,
    dequantize_blocks,
    is_blockwise_1x128,
    is_cublaslt_128x128,
)
from tests.gpu.fake_cuda import fake_cuda

register_configs()


@pytest.mark.parametrize("m, k, n", [(5, 384, 64), (16, 256, 256), (33, 160, 144)])
def test_blockwise_operands_have_the_layout_scaled_mm_checks(m, k, n):
    torch.manual_seed(0)
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.02
    data, scale_a, rows = blockwise_activation_operands(x)
    q = quantize(w, "fp8_e4m3", "block", (128, 128))
    mat2, scale_b = blockwise_weight_operands(q.data, q.scale)
    assert rows == m and data.shape[0] % 16 == 0  # tokens padded to 16, the pad sliced off later
    k_padded = 128 * math.ceil(k / 128)  # whole 128-wide K blocks only
    assert data.shape[1] == k_padded and mat2.shape == (k_padded, n) and mat2.t().is_contiguous()  # [K', N]
    assert scale_a.shape == (data.shape[0], math.ceil(k / 128)) and scale_a.stride() == (1, data.shape[0])
    assert is_blockwise_1x128(data, scale_a)
    assert is_cublaslt_128x128(mat2, scale_b)  # [L4, N/128], strides (1, L4)
    # The layout the contiguous (row-major) scales would have is refused: it is what the rules catch.
    wrong = scale_a.contiguous()
    assert wrong.shape[1] == 1 or not is_blockwise_1x128(data, wrong)


@pytest.mark.parametrize("m, k, n", [(5, 384, 64), (33, 160, 144)])
def test_blockwise_operands_dequantize_to_the_emulated_fp8_recipe(m, k, n):
    """What the blockwise GEMM computes, (a * scale_a) @ (b * scale_b), is the emulated ``fp8`` recipe."""
    torch.manual_seed(1)
    x, w = torch.randn(m, k) * 3, torch.randn(n, k) * 0.02
    data, scale_a, rows = blockwise_activation_operands(x)
    q = quantize(w, "fp8_e4m3", "block", (128, 128))
    mat2, scale_b = blockwise_weight_operands(q.data, q.scale)
    a = dequantize_blocks(data, scale_a, (1, 128))[:rows]  # [M, K]
    b = dequantize_blocks(mat2.t(), cublaslt_weight_scales(scale_b, k, n).t(), (128, 128)).t()  # [K, N]
    emulated = F.linear(
        fake_quantize(x, "fp8_e4m3", "group", (1, 128)), fake_quantize(w, "fp8_e4m3", "block", (128, 128))
    )
    torch.testing.assert_close(a @ b, emulated, rtol=1e-5, atol=1e-5)
    assert (a @ b - x @ w.t()).abs().max() > 0  # really quantized


@pytest.mark.parametrize("k", [128, 384, 512, 576, 896])
def test_blockwise_fp8_gemm_hands_cublaslt_padded_weight_scales_and_whole_k_blocks(monkeypatch, k):
    """The weight scales the blockwise ``fp8_gemm`` forward hands torch have cuBLASLt's layout (K blocks padded
    to a multiple of 4), so the product cuBLASLt computes from them is the emulated ``fp8`` recipe. Unpadded
    scales ([ceil(K/128), ceil(N/128)], strides (1, ceil(K/128))) are read at the wrong offsets for K = 128
    and 384: the second output block gets another block's scales or memory past the tensor (PR 166752).
    K = 576 (SmolLM2-135M's hidden size) ends in a partial 128-wide K block, which neither torch nor cuBLASLt
    documents: the GEMM is handed K zero-padded to whole blocks, whose product is the emulated recipe exactly
    (896, Qwen2.5-0.5B's hidden size, is 7 whole blocks)."""
    m, n = 37, 160  # two output blocks, the second partial; 37 tokens padded to 48
    torch.manual_seed(2)
    x, w = torch.randn(m, k) * 3, torch.randn(n, k) * 0.02
    gemm = EmulatedBlockwiseGemm()
    monkeypatch.setattr(torch, "_scaled_mm", gemm.scaled_mm_legacy)
    monkeypatch.setattr(F, "scaled_mm", gemm.scaled_mm)
    q = quantize(w, "fp8_e4m3", "block", (128, 128))
    mat2, scale_b = blockwise_weight_operands(q.data, q.scale)  # what QuantLinear.refresh caches
    out = scaled_mm_linear(x, mat2, scale_b, None, "fp8_e4m3", "group")  # QuantLinear's fp8_gemm forward

    ((mat_a, mat_b, _, handed, recipes),) = gemm.calls
    assert is_cublaslt_128x128(mat_b, handed), (tuple(handed.shape), handed.stride())
    assert recipes == (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)  # named, not inferred
    assert mat_a.shape[1] % 128 == 0 and mat_b.shape[0] == mat_a.shape[1] >= k  # whole K blocks
    emulated = F.linear(
        fake_quantize(x, "fp8_e4m3", "group", (1, 128)), fake_quantize(w, "fp8_e4m3", "block", (128, 128))
    )  # [M, N]
    assert out.shape == (m, n) and torch.isfinite(out).all()
    torch.testing.assert_close(out, emulated, rtol=1e-2, atol=1e-2)  # the GEMM writes bf16


@pytest.mark.parametrize(
    "recipe, capability, cuda, match",
    [
        ("fp8_channel", None, (12, 9), "needs a CUDA GPU"),
        ("fp8_channel", (8, 6), (12, 9), r"compute capability >= 8\.9.*has 8\.6"),
        ("fp8_tensor", (8, 9), (12, 1), None),
        ("fp8_channel", (10, 0), (12, 8), None),
        ("fp8", (8, 9), (12, 9), r"Hopper only \(compute capability 9\.x\).*has 8\.9.*'fp8_channel'"),
        ("fp8", (10, 0), (12, 9), r"Hopper only.*has 10\.0"),
        ("fp8", (9, 0), (12, 8), r"CUDA/cuBLASLt >= 12\.9.*12\.8"),
        ("fp8_block", (9, 0), (12, 9), None),
        ("int8", (9, 0), (12, 9), "runs recipes"),
    ],
)
def test_fp8_gemm_requirements_follow_scaled_mm(recipe, capability, cuda, match):
    reason = fp8_gemm_requirement(recipe, capability, cuda)
    if match is None:
        assert reason is None
    else:
        assert reason is not None and __import__("re").search(match, reason), reason


def _compose_rollout(*overrides: str):
    with initialize_config_dir(
        config_dir=str(CONFIG_DIR),
        version_base="1.3",
    ):
        return compose("train", overrides=["output_dir=/tmp/unused", *overrides])


def test_rollout_fp8_gemm_is_checked_at_config_time(monkeypatch):
    """``rollout=fp8_gemm`` validates on a Hopper node; elsewhere the config is refused naming the need."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ValueError, match=r"^rollout\.backend='fp8_gemm' with precision='fp8'.*needs a CUDA GPU.*'emulate'"
    ):
        validate(_compose_rollout("rollout=fp8_gemm"))
    fake_cuda(monkeypatch, capability=(9, 0), cuda_version="12.9")
    assert validate(_compose_rollout("rollout=fp8_gemm")).engine.keywords["backend"] == "fp8_gemm"
    fake_cuda(monkeypatch, capability=(8, 9), cuda_version="12.9")
    with pytest.raises(ValueError, match=r"Hopper only.*use recipe 'fp8_channel'"):
        validate(_compose_rollout("rollout=fp8_gemm"))
    validate(_compose_rollout("rollout=fp8_gemm", "rollout.precision=fp8_channel"))


def test_torch_engine_device_and_backend_checks(monkeypatch, int8_isa):
    with pytest.raises(ValueError, match="backend='fp8_gemm'.*runs precision in"):
        TorchRolloutEngine.check_args(precision="int8", backend="fp8_gemm")
    fake_cuda(monkeypatch, capability=(9, 0), count=2, current=1)
    for backend in ("int8", "fbgemm"):  # the integer GEMMs, whatever the CPU
        with pytest.raises(ValueError, match=f"device='cuda:1'.*backend='{backend}'.*CPU only"):
            TorchRolloutEngine.check_args(precision="int8", backend=backend, device="cuda")
    default = {"vnni": "int8", "avx2": "fbgemm"}[int8_isa]  # int8's default backend: this CPU's integer GEMM
    with pytest.raises(ValueError, match=f"device='cuda:1'.*backend='{default}'.*CPU only"):
        TorchRolloutEngine.check_args(precision="int8", device="cuda")
    assert TorchRolloutEngine.check_args(precision="bf16", device="cuda")["device"] == "cuda:1"
    with pytest.raises(ValueError, match="device='cuda:7'.*2 CUDA device"):
        TorchRolloutEngine.check_args(precision="bf16", device="cuda:7")


def test_torch_engine_follows_the_device_of_its_model():
    from ais_lightning.models import build_tiny_qwen3

    engine = TorchRolloutEngine(build_tiny_qwen3(seed=0), precision="fp32")
    assert engine.device == torch.device("cpu")
    meta = TorchRolloutEngine(build_tiny_qwen3(seed=0), precision="fp32", device="meta")
    assert meta.device.type == "meta"  # an explicit device moves the engine's copy there


CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _recipes_here() -> list[str]:
    recipes = ["fp8_tensor", "fp8_channel"]
    if (
        CUDA_FP8
        and fp8_gemm_requirement(
            "fp8",
            torch.cuda.get_device_capability(),
            tuple(int(p) for p in torch.version.cuda.split(".")[:2]),
        )
        is None
    ):
        recipes.append("fp8")
    return recipes


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU of compute capability >= 8.9")
@pytest.mark.parametrize("recipe", _recipes_here())
@pytest.mark.parametrize("k", [128, 384, 512, 576, 896])  # ceil(K/128) = 1, 3; 576: a partial K block
def test_fp8_gemm_matches_the_emulated_recipe_on_gpu(recipe, k):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, 160, bias=False).cuda()  # two output blocks, the second partial
    x = torch.randn(37, k, device="cuda") * 2
    with torch.no_grad():
        real = QuantLinear.from_linear(lin, recipe, backend="fp8_gemm")(x)
        emulated = QuantLinear.from_linear(lin, recipe, backend="emulate")(x)
        exact = lin(x)
    err_real = (real - emulated).abs().max().item()
    err_quant = (emulated - exact).abs().max().item()
    print(f"{recipe}: |fp8_gemm - emulate| {err_real:.4f}, |emulate - fp32| {err_quant:.4f}")
    # same quantized operands: only accumulation order and the bf16 output differ
    torch.testing.assert_close(real, emulated, rtol=2e-2, atol=2e-2)
    assert err_real < err_quant  # closer to the emulation than the quantization error itself
