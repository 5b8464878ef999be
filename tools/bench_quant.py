"""Time fp32 vs integer-GEMM int8 vs emulated FP8/FP4 linears at a few shapes; print a markdown table.

``fp32`` is ``nn.Linear`` (``F.linear``: MKL on x86 CPU builds, what HF models and our engines run);
``fp32 oneDNN`` is the same GEMM through oneDNN with a prepacked weight
(``torch.ops.mkldnn._linear_pointwise``, the kernel inductor's CPU weight prepacking uses), shown
because the fp32 baseline an int8 speed-up is measured against depends on the kernel. The int8 recipe runs on
both integer GEMMs, ``torch._int_mm`` (backend ``int8``) and fbgemm's (backend ``fbgemm``), and emulated
(``ais_lightning.quant.cpu_int8``: which one is fast depends on the CPU). The weights are drawn as Hugging Face
initializes an LM's linears (normal, std 0.02): fbgemm's cost depends on them (the excess of
``split_weight_pairs``).

Usage: .venv/bin/python tools/bench_quant.py [--repeats 20] [--threads N]
Each cell is the best (minimum) wall time of ``--repeats`` forward calls under ``torch.inference_mode``
(the minimum is the least disturbed by other processes on a shared machine);
ratios are to the fp32 ``nn.Linear`` of the same shape (M tokens x K in x N out). Not a test.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from ais_lightning.quant import QuantLinear
from ais_lightning.quant.cpu_int8 import cpu_int8_isa, fbgemm_available

SHAPES = [(128, 1024, 1024), (32, 1024, 4096), (512, 512, 512), (64, 1024, 3072), (64, 3072, 1024)]
VARIANTS = [
    ("fp32", None, None),
    ("fp32 oneDNN", None, "onednn"),
    ("int8 torch._int_mm", "int8", "int8"),
    ("int8 fbgemm", "int8", "fbgemm"),
    ("int8 emulate", "int8", "emulate"),
    ("fp8 emulate", "fp8", "emulate"),
    ("nvfp4 emulate", "nvfp4", "emulate"),
]


def onednn_linear(linear: nn.Linear, batch: int):
    """``linear`` as a oneDNN GEMM with the weight reordered once for ``batch`` rows; None without oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch)
    bias = None if linear.bias is None else linear.bias.detach()
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def build_variant(linear: nn.Linear, recipe: str | None, backend: str | None, batch: int):
    """The variant ``(recipe, backend)`` of ``linear``; None where this CPU or build cannot run it."""
    if backend == "onednn":
        return onednn_linear(linear, batch)
    if backend == "fbgemm" and not fbgemm_available():
        return None
    return linear if recipe is None else QuantLinear.from_linear(linear, recipe, backend=backend)


def _best_ms(fn, x, repeats: int) -> float:
    fn(x)  # warm-up (and cache fills)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"CPU int8 kernels {cpu_int8_isa()}, repeats {args.repeats}\n"
    )
    print("| M x K x N | " + " | ".join(f"{name} ms (x fp32)" for name, _, _ in VARIANTS) + " |")
    print("|---" * (len(VARIANTS) + 1) + "|")
    for m, k, n in SHAPES:
        torch.manual_seed(0)
        linear = nn.Linear(k, n)
        with torch.no_grad():
            linear.weight.normal_(0.0, 0.02)
        x = torch.randn(m, k)
        cells, base = [], None
        with torch.inference_mode():
            for _, recipe, backend in VARIANTS:
                layer = build_variant(linear, recipe, backend, m)
                if layer is None:
                    cells.append("n/a")
                    continue
                ms = _best_ms(layer, x, args.repeats)
                base = base or ms
                cells.append(f"{ms:.2f} ({ms / base:.2f})")
        print(f"| {m}x{k}x{n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
