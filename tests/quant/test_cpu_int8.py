"""The CPU's integer GEMMs (ais_lightning.quant.cpu_int8): the probe of the int8 kernels, the default backend, and
fbgemm's GEMM computing the int8 recipe's integers exactly, also with the kernels of CPUs without VNNI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ais_lightning.quant import QuantLinear, cpu_int8, quantize
from ais_lightning.quant.cpu_int8 import (
    FBGEMM_PAIR_LIMIT,
    INT8_ISA_ENV,
    cpu_int8_isa,
    default_int8_backend,
    fbgemm_available,
    fbgemm_linear,
    fbgemm_weight_operands,
    split_weight_pairs,
)

needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="fbgemm's kernels need an x86 CPU with AVX2")


def _by_integers(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The int8 recipe computed independently: codes from ``quantize``, their product in int64, scaled in float64."""
    qx, qw = quantize(x, "int8", "token"), quantize(w, "int8", "channel")
    acc = qx.data.long() @ qw.data.long().t()  # [M, N], exact
    return acc.double() * qx.scale.double() * qw.scale.double().reshape(1, -1)


def _big_pairs(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight ``[N, K]`` whose rows hold adjacent pairs of large values of equal and opposite signs."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    w[:, 2:6] = torch.tensor([1.0, 0.9, -0.95, -1.0])  # |codes| ~ 127 + 114, 120 + 127: beyond the limit
    w[::3, 8:10] = torch.tensor([-1.0, -1.0])
    w[:, 10:12] = torch.tensor([1.0, -1.0])  # opposite signs: never beyond
    return w


def test_the_probe_can_be_forced_and_names_a_bad_value(monkeypatch):
    for isa, backend in (("vnni", "int8"), ("avx2", "fbgemm"), ("none", "emulate")):
        monkeypatch.setenv(INT8_ISA_ENV, isa.upper())
        assert (cpu_int8_isa(), default_int8_backend()) == (isa, backend)
    monkeypatch.setenv(INT8_ISA_ENV, "avx512")
    with pytest.raises(
        ValueError, match="AIS_LIGHTNING_INT8_ISA must be one of \\['vnni', 'avx2', 'none'\\]"
    ):
        cpu_int8_isa()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU flags from /proc/cpuinfo")
def test_the_probe_reads_the_cpu_flags(monkeypatch):
    monkeypatch.delenv(INT8_ISA_ENV, raising=False)
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    expected = "vnni" if "avx512_vnni" in flags else "avx2" if "avx2" in flags else "none"
    assert cpu_int8_isa() == expected


def test_split_weight_pairs_by_hand():
    codes = torch.tensor(
        [[127, 127, 127, -127, -90, -50, 7], [20, 127, 64, 65, -65, -64, -127]], dtype=torch.int8
    )
    capped, excess = split_weight_pairs(codes)
    # (127, 127): 126 over the limit, taken from the first (a tie); (127, -127): opposite signs, kept; (-90, -50):
    # 12 over, from -90; (20, 127): 19 over, from 127; (64, 65): 1 over, from 65; (-65, -64): 1 over, from -65;
    # K = 7 is odd: the last column pairs with a zero
    assert capped.tolist() == [[1, 127, 127, -127, -78, -50, 7], [20, 108, 64, 64, -64, -64, -127]]
    assert excess.tolist() == [[126, 0, 0, 0, -12, 0, 0], [0, 19, 0, 1, -1, 0, 0]]


def test_split_weight_pairs_caps_every_pair_and_keeps_the_sum():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (33, 50), generator=g, dtype=torch.int8)
    capped, excess = split_weight_pairs(codes)
    assert torch.equal(capped.to(torch.int16) + excess, codes.to(torch.int16))
    wide, capped_wide = codes.to(torch.int16).reshape(33, 25, 2), capped.to(torch.int16).reshape(33, 25, 2)
    same_sign = wide.prod(-1) > 0  # [33, 25]
    assert capped_wide.abs().sum(-1)[same_sign].max() == FBGEMM_PAIR_LIMIT  # capped exactly at the limit
    assert torch.equal(capped_wide[~same_sign], wide[~same_sign])  # opposite signs never saturate: kept
    over = same_sign & (wide.abs().sum(-1) > FBGEMM_PAIR_LIMIT)
    assert torch.equal((excess.reshape(33, 25, 2) != 0).sum(-1), over.long())  # one entry per pair beyond
    assert (capped.sign() * codes.sign() >= 0).all()  # capping never flips a sign


@needs_fbgemm
@pytest.mark.parametrize("sparse_excess", [0.0, 1.0])
def test_fbgemm_linear_is_the_integer_product(monkeypatch, sparse_excess):
    """Both forms of the excess: a second fbgemm GEMM (``SPARSE_EXCESS`` 0) and a sparse product (1)."""
    monkeypatch.setattr(cpu_int8, "SPARSE_EXCESS", sparse_excess)
    x = torch.randn(7, 45) * torch.linspace(0.1, 5, 45)
    x[3] = 0.0  # a zero token: the scale floor
    w, bias = _big_pairs(24, 45), torch.randn(24)
    weight = fbgemm_weight_operands(w)
    assert weight.excess_codes == 24 * 2 + 8  # two pairs per row beyond the limit, one more every third row
    assert (weight.excess_sparse is not None, weight.excess_packed is not None) == (
        sparse_excess > 0,
        not sparse_excess,
    )
    got = fbgemm_linear(x, weight, bias)
    torch.testing.assert_close(got.double(), _by_integers(x, w) + bias.double(), rtol=1e-6, atol=1e-5)
    x3 = torch.randn(2, 3, 45)
    torch.testing.assert_close(fbgemm_linear(x3, weight)[1], fbgemm_linear(x3[1], weight))  # rows independent


@needs_fbgemm
@pytest.mark.parametrize("outliers", [False, True])
def test_the_three_int8_backends_agree(outliers):
    lin = nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(_big_pairs(32, 64, seed=2))
    x = torch.randn(9, 64)
    x[:, 11] *= 200.0
    layers = {b: QuantLinear.from_linear(lin, "int8", backend=b) for b in ("emulate", "int8", "fbgemm")}
    with torch.no_grad():
        if outliers:
            for layer in layers.values():
                layer.set_outlier_channels(torch.tensor([11, 30]))
        out = {b: layer(x) for b, layer in layers.items()}
        torch.testing.assert_close(out["fbgemm"], out["emulate"], rtol=1e-5, atol=1e-5)
        assert torch.equal(
            out["fbgemm"], out["int8"]
        )  # the same integers, scaled alike (K < 1040: sums exact)
        assert (out["fbgemm"] - lin(x)).abs().max() > 0  # not silently fp32


def test_fbgemm_backend_checks_its_recipe_and_device():
    with pytest.raises(ValueError, match="backend 'fbgemm' .*only runs the 'int8' recipe, got 'fp8_block'"):
        QuantLinear.from_linear(nn.Linear(16, 16), "fp8", backend="fbgemm")
    with pytest.raises(ValueError, match="backend 'fbgemm' runs on CPU .*meta"):
        QuantLinear.from_linear(nn.Linear(16, 16, device="meta"), "int8", backend="fbgemm")


WITHOUT_VNNI = """
import torch, warnings
from ais_lightning.quant.cpu_int8 import fbgemm_linear, fbgemm_weight_operands
codes = torch.full((8, 64), 127.0)
codes[1::2] *= -1  # every adjacent weight pair sums to 254 in magnitude: the worst case
x = torch.ones(3, 64)
x[1] = -1.0
x[2, ::2] = -1.0  # activation codes +-127: u8 operands 255 and 1
exact = x.double() @ (codes.double() * 0.01).t()
split = fbgemm_linear(x, fbgemm_weight_operands(codes * 0.01))  # the excess as a second GEMM
few = codes.clone()
few[:, 2:] = 1.0
few[::2, 2:] = -1.0  # one equal-sign pair beyond the limit per row: a sparse excess
split_sparse = fbgemm_linear(x, fbgemm_weight_operands(few * 0.01))
assert split_sparse.shape == (3, 8)
error_sparse = (split_sparse.double() - x.double() @ (few.double() * 0.01).t()).abs().max().item()
warnings.simplefilter("ignore")
torch.backends.quantized.engine = "fbgemm"
qw = torch._make_per_channel_quantized_tensor(
    codes.to(torch.int8), torch.full((8,), 0.01, dtype=torch.double), torch.zeros(8, dtype=torch.long), 0
)
unsplit = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
    x * 127, 1.0, 128, torch.ops.quantized.linear_prepack(qw, None)
) / 127
print(max((split.double() - exact).abs().max().item(), error_sparse), (unsplit.double() - exact).abs().max().item())
"""


@needs_fbgemm
@pytest.mark.parametrize("isa", ["AVX2", "AVX512"])
def test_the_kernels_of_a_cpu_without_vnni_stay_exact(isa):
    """fbgemm's kernels for AVX2 and AVX-512 without VNNI (forced by FBGEMM_ENABLE_INSTRUCTIONS) add adjacent u8 x s8
    products in a saturating int16: the same worst-case weights packed as they are saturate there (which shows the
    forced kernel ran), and the split weight gives the exact product."""
    env = {**os.environ, "FBGEMM_ENABLE_INSTRUCTIONS": isa, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_VNNI], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    split_error, unsplit_error = map(float, proc.stdout.split())
    assert split_error < 1e-4  # outputs ~ +-322: fp32 rounding only
    assert unsplit_error > 1.0  # saturated pair sums
