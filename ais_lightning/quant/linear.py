"""QuantLinear: a drop-in ``nn.Linear`` that runs with quantized weights and activations.

Backends:

- ``"emulate"`` (any device): exact quantize-dequantize numerics of the recipe for the weight
  (cached) and the input activation (dynamic, every forward), then an fp32/bf16 ``F.linear``.
  This is how FP8/FP4 rollouts are emulated on CPU (FP8-RL, arXiv 2601.18150; QeRL/QaRL-style
  fake quantization).
- ``"int8"`` (CPU): the ``int8`` recipe on an integer GEMM, :func:`~ais_lightning.quant.cpu_int8.int8_linear`:
  the activation quantized per token (symmetric, scale ``amax / 127``), the weight per output channel, their
  product accumulated exactly in int32 by ``torch._int_mm`` (oneDNN; fast where the CPU has AVX512-VNNI) and
  scaled back in fp32. The integers are the emulated recipe's, so the two backends agree up to fp32 rounding.
  Only with the ``int8`` recipe.
- ``"fbgemm"`` (CPU): the same recipe and integers on fbgemm's GEMM, fast on every x86 CPU with AVX2
  (:func:`~ais_lightning.quant.cpu_int8.fbgemm_linear`: the weight's adjacent pairs capped where its AVX2 kernel
  would saturate, the rest in a sparse product). Which backend is fast on which CPU: :mod:`.cpu_int8`.
- ``"fp8_gemm"`` (CUDA): the real FP8 GEMM, ``torch._scaled_mm`` on E4M3 data. Recipes ``fp8_tensor``
  (per-tensor scales) and ``fp8_channel`` (per-row: weight per output channel, activation per token) run
  wherever ``_scaled_mm`` has them (compute capability >= 8.9); ``fp8`` / ``fp8_block`` run the
  blockwise form of the emulated ``fp8`` recipe (1x128 activation groups x 128x128 weight blocks,
  DeepSeek-V3), which torch only has on Hopper (compute capability 9.x) with CUDA/cuBLASLt >= 12.9
  (``aten/src/ATen/native/cuda/ScaledBlas.cpp``: ``_check_deepseek_support``; on Blackwell the block-scaled
  FP8 GEMM is MXFP8's, a different recipe), through ``torch.nn.functional.scaled_mm`` with the weight
  scales in cuBLASLt's padded layout (:func:`blockwise_weight_operands`) and K zero-padded to whole 128-wide
  blocks (:func:`pad_reduction`: a partial last K block is undocumented). Every form accumulates in FP32
  (``use_fast_accum=False``), as the emulation does. :func:`fp8_gemm_requirement`
  names what a device lacks.
  Refuses a non-CUDA weight (the CPU kernel exists for tensor/row scales but is slower than emulation).

**Outlier channels** (:mod:`.outliers`, any backend): :meth:`QuantLinear.set_outlier_channels` keeps some
input channels in the layer's dtype, ``y = Q(x * keep) Q(W * keep)^T + x[:, out] W[:, out]^T + b``; the
columns are zeroed in place so blocks along K keep their layout. ``input_range`` (an
:class:`~ais_lightning.quant.outliers.InputRange`, set by an
:class:`~ais_lightning.quant.outliers.OutlierCalibration`) records the input's per-channel range while set.

Recipes with ``ocs_ratio > 0`` (emulate only) split the weight's outlier input channels at every
refresh (:func:`ais_lightning.quant.ocs.ocs_split`, rounding-aware for the recipe's weight grid) and run
``F.linear(x[..., index], W'_q)``: the split activation columns are duplicated, then quantized with the
recipe's activation scaling on the ``K + S`` columns, as a kernel would see them.
:meth:`QuantLinear.set_recipe` / :func:`~ais_lightning.quant.model.switch_recipe` change the recipe of existing
layers in place
(the fp32 master ``weight`` is untouched; the caches are re-derived): a progressive precision schedule
(:mod:`.schedule`) walks a model from int8 to int4 to int2 with them.

The module keeps ``weight``/``bias`` as ordinary parameters (the same objects as the wrapped
``nn.Linear``), so ``state_dict`` keys are unchanged and weight sync by ``load_state_dict`` works. The
quantized weight is a cache: call :meth:`QuantLinear.refresh` (or
:func:`~ais_lightning.quant.model.refresh_quantized`) after
changing the weight. As a safety net, ``forward`` also refreshes when the weight's autograd version
counter or storage changed (in-place ``copy_``/optimizer steps, ``load_state_dict``); writes through
``weight.data`` and in-place writes to inference tensors (no version counter) are invisible to that check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_int8 import (
    INTEGER_BACKENDS,
    fbgemm_available,
    fbgemm_linear,
    fbgemm_weight_operands,
    int8_linear,
    int8_weight_operands,
)
from .ocs import merge_split, ocs_split
from .outliers import InputRange
from .recipes import QuantRecipe, get_recipe
from .scaling import fake_quantize, quantize

BACKENDS = ("emulate", "int8", "fbgemm", "fp8_gemm")
"""Known QuantLinear backends."""
BACKEND_KERNELS = {
    "emulate": "fake quantization, float GEMMs",
    "int8": "torch._int_mm, oneDNN's int8 GEMM",
    "fbgemm": "fbgemm's int8 GEMM",
    "fp8_gemm": "torch._scaled_mm, an FP8 GEMM",
}
"""What runs each backend's products (logs and run summaries)."""

FP8_GEMM_RECIPES = ("fp8_tensor", "fp8_channel", "fp8_block")
"""Recipes the ``fp8_gemm`` backend runs (``fp8`` is ``fp8_block``): per-tensor, per-row and blockwise
scales of ``torch._scaled_mm``."""
FP8_GEMM_BLOCKWISE = ("fp8_block",)
"""``fp8_gemm`` recipes that need the blockwise (1x128 x 128x128) ``_scaled_mm``: Hopper, CUDA >= 12.9."""


def fp8_gemm_requirement(
    recipe: str, capability: tuple[int, int] | None, cuda_version: tuple[int, ...] = ()
) -> str | None:
    """What a device lacks to run ``recipe`` on the ``fp8_gemm`` backend, or None if it runs there.

    ``capability``: the CUDA compute capability, None for a non-CUDA device; ``cuda_version``: the CUDA
    version of the torch build (``torch.version.cuda``, a proxy for the bundled cuBLASLt). Follows torch's
    ``aten/src/ATen/native/cuda/ScaledBlas.cpp``: ``_scaled_mm`` needs compute capability >= 8.9
    (``scaled_mm_arch_allowed``); the DeepSeek-style 1x128 x 128x128 scaling needs major == 9 and
    cuBLASLt >= 12.9 (``_check_deepseek_support``; the 1x128 scale mode is
    ``CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F``, CUDA >= 12.9).
    """
    name = get_recipe(recipe).name
    if name not in FP8_GEMM_RECIPES:
        return f"backend 'fp8_gemm' runs recipes {list(FP8_GEMM_RECIPES)} (fp8 = fp8_block), not {name!r}"
    if capability is None:
        return "backend 'fp8_gemm' needs a CUDA GPU (torch._scaled_mm FP8 kernels)"
    if tuple(capability) < (8, 9):
        return (
            f"backend 'fp8_gemm' needs compute capability >= 8.9 (FP8 tensor cores: Ada, Hopper, Blackwell), "
            f"the GPU has {capability[0]}.{capability[1]}"
        )
    if name in FP8_GEMM_BLOCKWISE:
        if capability[0] != 9:
            return (
                f"recipe {name!r} on backend 'fp8_gemm' needs the blockwise torch._scaled_mm (1x128 activation "
                f"x 128x128 weight scales), which torch runs on Hopper only (compute capability 9.x), the GPU "
                f"has {capability[0]}.{capability[1]}; use recipe 'fp8_channel' on this GPU, or backend "
                "'emulate' for the blockwise numerics"
            )
        if tuple(cuda_version) < (12, 9):
            shown = ".".join(map(str, cuda_version)) or "none"
            return (
                f"recipe {name!r} on backend 'fp8_gemm' needs CUDA/cuBLASLt >= 12.9 for blockwise "
                f"torch._scaled_mm, this torch build has CUDA {shown}"
            )
        if not hasattr(F, "scaled_mm"):
            return (
                f"recipe {name!r} on backend 'fp8_gemm' needs torch >= 2.10 (torch.nn.functional.scaled_mm, "
                f"which takes cuBLASLt's padded block-scale layout), this is torch {torch.__version__}"
            )
    return None


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def outer_dim_major(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` (2-D) with the same values laid out column-major: strides ``(1, rows)``."""
    return scale.t().contiguous().t()


def blockwise_weight_operands(weight_fp8: torch.Tensor, block_scale: torch.Tensor) -> tuple:
    """``(mat2, scale_b)`` of the blockwise FP8 GEMM (:func:`scaled_mm_linear`) from a weight quantized in
    128x128 blocks.

    ``weight_fp8``: ``[N, K]`` E4M3, row-major; ``block_scale``: ``[ceil(N/128), ceil(K/128)]`` float32, the
    dequantization scales (``w ~= weight_fp8 * scale`` per block). Returns ``mat2``, ``[K', N]`` column-major (the
    transpose of a contiguous ``[N, K']``), with K zero-padded to K' = ceil(K/128) x 128 (:func:`pad_reduction`),
    and ``scale_b`` in cuBLASLt's layout: ``[L4, ceil(N/128)]`` with strides ``(1, L4)``, L4 = ceil(K/128) rounded
    up to a multiple of 4, the padding zeros. cuBLASLt gets only the scales' data pointer and reads them with that
    leading dimension; torch's ``_scaled_block1x128_block128x128`` (``aten/src/ATen/native/cuda/ScaledBlas.cpp``)
    checks this layout, while the legacy ``torch._scaled_mm`` took the unpadded one and gave silently wrong
    products whenever ceil(K/128) % 4 != 0 (PyTorch PR 166752).
    """
    n_blocks, k_blocks = block_scale.shape
    padded = block_scale.new_zeros(n_blocks, _round_up(k_blocks, 4))  # [N/128, L4], row-major
    padded[:, :k_blocks] = block_scale
    return pad_reduction(weight_fp8).t(), padded.t()  # [K', N] col-major, [L4, N/128] strides (1, L4)


def pad_reduction(x2d: torch.Tensor, multiple: int = 128) -> torch.Tensor:
    """``x2d`` ``[R, K]`` (any dtype, FP8 too) contiguous with K zero-padded to a multiple of ``multiple``.

    The blockwise FP8 GEMM gets only whole 128-wide K blocks: torch checks the scales' shapes with ceil(K/128)
    (``ScaledBlas.cpp``) but neither torch nor cuBLASLt documents what a partial last K block does. Zero columns
    add nothing to the product and raise no block's amax, so the padded product is the emulated recipe exactly
    (whose blocks are zero-padded the same way, ``ais_lightning.quant.scaling``).
    """
    rows, k = x2d.shape
    pad = _round_up(k, multiple) - k
    if not pad:
        return x2d.contiguous()
    out = torch.zeros(rows, k + pad, dtype=x2d.dtype, device=x2d.device)  # [R, K']
    out[:, :k] = x2d
    return out


def blockwise_activation_operands(x2d: torch.Tensor, fmt: str = "fp8_e4m3") -> tuple:
    """``(mat1, scale_a, rows)`` of a blockwise ``torch._scaled_mm`` for activations ``x2d`` ``[M, K]``.

    Quantized per token in groups of 128 along K (the ``fp8`` recipe's activation scaling), K zero-padded to
    a multiple of 128 (:func:`pad_reduction`, as the weight). The token dimension is zero-padded to a multiple of
    16 (an all-zero row quantizes to zeros); ``rows`` = M, the rows of the output to keep. ``scale_a``:
    ``[M', ceil(K/128)]`` float32 with strides ``(1, M')``, outer-dim-major as ``is_blockwise_1x128_scaling`` of
    torch's ``ScaledBlas.cpp`` requires.
    """
    rows = x2d.shape[0]
    pad = _round_up(max(rows, 1), 16) - rows
    if pad:
        x2d = torch.cat([x2d, x2d.new_zeros(pad, x2d.shape[1])])
    qx = quantize(pad_reduction(x2d), fmt, "group", (1, 128), check_finite=False, name="input")
    return qx.data.contiguous(), outer_dim_major(qx.scale), rows


def fp8_gemm_weight_operands(weight: torch.Tensor, recipe: str | QuantRecipe) -> tuple:
    """``(weight_t, weight_scale)`` of :func:`scaled_mm_linear` for ``weight`` ``[N, K]`` under an ``fp8_gemm``
    recipe (what :class:`QuantLinear` caches): ``[K, N]`` column-major E4M3 codes and a 0-d (per tensor),
    ``[1, N]`` (per output channel) or blockwise (:func:`blockwise_weight_operands`: K padded, ``[L4, N/128]``)
    scale."""
    r = get_recipe(recipe)
    if r.weight_scaling == "block":
        q = quantize(weight, r.weight_fmt, "block", r.weight_block, name="weight")
        return blockwise_weight_operands(q.data, q.scale)
    q = quantize(weight, r.weight_fmt, r.weight_scaling, name="weight")
    scale = q.scale.reshape(()) if r.weight_scaling == "tensor" else q.scale.reshape(1, -1)
    return q.data.t(), scale  # [K, N] column-major view of the row-major [N, K]


def scaled_mm_linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str = "fp8_e4m3",
    act_scaling: str = "token",
) -> torch.Tensor:
    """``x @ W.T + bias`` by ``torch._scaled_mm`` with a dynamically quantized activation.

    ``weight_t``: ``[K, N]`` FP8, column-major (the transpose of a contiguous ``[N, K]``);
    ``weight_scale``: 0-d (per tensor), ``[1, N]`` (per output channel) or, with ``act_scaling="group"``,
    the blockwise ``scale_b`` of :func:`blockwise_weight_operands` (``[L4, ceil(N/128)]``, cuBLASLt's padded
    layout). ``act_scaling``: ``"tensor"`` (0-d scale), ``"token"`` (``[M, 1]`` scale) or ``"group"`` (1x128
    groups, :func:`blockwise_activation_operands`). Row-wise and blockwise scaling write a bf16 output (CUDA
    requires it), cast back to ``x``'s dtype. The tensor/row forms run on CPU too (slowly: only useful
    for checking numerics); the blockwise form runs on Hopper only (:func:`fp8_gemm_requirement`) through
    ``torch.nn.functional.scaled_mm`` (torch >= 2.10), which is told the scaling types: the legacy
    ``torch._scaled_mm`` infers them from the scales' shapes and refuses the padded layout.
    """
    k = x.shape[-1]
    x2d = x.reshape(-1, k)  # [M, K]
    rows = x2d.shape[0]
    if act_scaling == "group":
        data, scale_a, rows = blockwise_activation_operands(x2d, fmt)  # [M', K], [M', K/128]
        y = F.scaled_mm(
            data,
            weight_t,
            scale_a=scale_a,
            scale_recipe_a=F.ScalingType.BlockWise1x128,
            scale_b=weight_scale,  # [L4, N/128], strides (1, L4)
            scale_recipe_b=F.ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
            use_fast_accum=False,  # FP32 accumulation, as the emulation (Hopper's fast FP8 accumulation is not)
        )  # [M', N]
    else:
        qx = quantize(x2d, fmt, act_scaling, check_finite=False, name="input")
        data = qx.data.contiguous()
        scale_a = qx.scale.reshape(()) if act_scaling == "tensor" else qx.scale.reshape(-1, 1)  # [] or [M, 1]
        per_tensor = scale_a.dim() == 0 and weight_scale.dim() == 0
        out_dtype = torch.float32 if per_tensor else torch.bfloat16  # row-wise scaling: bf16 output
        y = torch._scaled_mm(
            data, weight_t, scale_a=scale_a, scale_b=weight_scale, out_dtype=out_dtype, use_fast_accum=False
        )
    y = y[:rows].to(x.dtype)  # [M, N]
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], weight_t.shape[1])


def _tensor_stamp(t: torch.Tensor) -> tuple:
    # Inference tensors (created under torch.inference_mode) have no version counter: only storage is tracked.
    version = -1 if t.is_inference() else t._version
    return (t.data_ptr(), version, t.dtype, t.device)


class QuantLinear(nn.Linear):
    """``nn.Linear`` whose forward uses quantized weights and activations per a :class:`QuantRecipe`.

    Gradients (when enabled) pass straight through the rounding (straight-through estimator,
    Bengio et al. 2013), so the layer can also be used for quantization-aware training.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: str | QuantRecipe = "fp8",
        backend: str = "emulate",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_outliers()
        self._setup(recipe, backend)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: str | QuantRecipe, backend: str = "emulate"
    ) -> QuantLinear:
        """Wrap an existing ``nn.Linear``, sharing its ``weight``/``bias`` Parameter objects."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.register_parameter("bias", linear.bias)
        layer.train(linear.training)
        layer._init_outliers()
        layer._setup(recipe, backend)
        return layer

    def _init_outliers(self) -> None:
        # Calibration state (kept across set_recipe): the input channels kept in high precision, and the
        # observer of the input's per-channel range while an OutlierCalibration observes this layer.
        self.outlier_channels: torch.Tensor | None = None  # [k] ascending input channels, or None
        self.input_range: InputRange | None = None

    def _setup(self, recipe: str | QuantRecipe, backend: str) -> None:
        recipe = get_recipe(recipe)
        self._check_backend(recipe, backend)  # before any state changes, so a refused switch changes nothing
        self.recipe = recipe
        self.backend = backend
        # Caches derived from `weight` (plain attributes, not buffers: they are no model state, so they
        # stay out of state dicts and weight syncs; a device move changes the stamp and re-derives them).
        self.weight_fq: torch.Tensor | None = None  # emulate: fake-quantized weight [N, K] (OCS: [N, K + S])
        self.weight_q_t: torch.Tensor | None = None  # int8 / fp8_gemm: [K, N] col-major codes
        self.weight_fbgemm = None  # fbgemm: its prepacked weight and the sparse excess (FbgemmWeight)
        self.weight_q_scale: torch.Tensor | None = None  # int8: [N]; fp8_gemm: [], [1, N] or [L4, N/128]
        self.ocs_index: torch.Tensor | None = None  # emulate + OCS: [K + S] input column of each split column
        self.ocs_channels: torch.Tensor | None = None  # emulate + OCS: [S] split input channels
        self.weight_outliers: torch.Tensor | None = None  # outlier channels: W[:, out] [N, k], high precision
        self._keep: torch.Tensor | None = None  # outlier channels: [K], 0 at them, 1 elsewhere (x's dtype)
        self._stamp = None
        self.refresh()

    def set_recipe(self, recipe: str | QuantRecipe, backend: str | None = None) -> None:
        """Run this layer with another recipe (and backend; None keeps the current one), in place.

        ``weight``/``bias`` (the master parameters) are untouched; the quantized caches are re-derived.
        An incompatible recipe/backend raises ValueError and leaves the layer as it was.
        """
        self._setup(recipe, self.backend if backend is None else backend)

    def _check_backend(self, recipe: QuantRecipe, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
        if recipe.ocs_ratio > 0 and self.outlier_channels is not None:
            raise ValueError(
                f"recipe {recipe.name!r} splits outlier channels itself (ocs_ratio={recipe.ocs_ratio}); this layer "
                "keeps outlier channels in high precision (set_outlier_channels): use one or the other"
            )
        if recipe.ocs_ratio > 0 and backend != "emulate":
            raise ValueError(
                f"recipe {recipe.name!r} splits outlier channels (ocs_ratio={recipe.ocs_ratio}), which only "
                f"backend 'emulate' runs, got backend {backend!r}"
            )
        if backend in INTEGER_BACKENDS:
            kernel = "torch._int_mm" if backend == "int8" else "fbgemm"
            if recipe.name != "int8":
                raise ValueError(
                    f"backend {backend!r} (integer W8A8 GEMM) only runs the 'int8' recipe, got {recipe.name!r}"
                )
            if self.weight.device.type != "cpu":
                raise ValueError(
                    f"backend {backend!r} runs on CPU ({kernel}), weight is on {self.weight.device}"
                )
            if backend == "fbgemm" and not fbgemm_available():
                raise ValueError(
                    "backend 'fbgemm' needs fbgemm's quantized kernels (an x86 CPU with AVX2); this torch build "
                    f"has {torch.backends.quantized.supported_engines}: use backend 'emulate'"
                )
        if backend == "fp8_gemm":
            if recipe.name not in FP8_GEMM_RECIPES:
                raise ValueError(
                    f"backend 'fp8_gemm' supports recipes {FP8_GEMM_RECIPES} (fp8 = fp8_block), got {recipe.name!r}"
                )
            if self.weight.device.type == "cuda":
                capability = tuple(torch.cuda.get_device_capability(self.weight.device))
                cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
                reason = fp8_gemm_requirement(recipe.name, capability, cuda)
                if reason is not None:
                    raise ValueError(reason)
            if self.weight.device.type != "cuda":
                raise RuntimeError(
                    f"backend 'fp8_gemm' needs the weight on a CUDA device (torch._scaled_mm FP8 kernels), "
                    f"got {self.weight.device}; use backend='emulate' for FP8 numerics on CPU"
                )
            if self.in_features % 16 or self.out_features % 16:
                raise ValueError(
                    f"backend 'fp8_gemm' needs in/out features divisible by 16, got {self.in_features}x{self.out_features}"
                )

    def _current_stamp(self) -> tuple:
        """Identity of the current weight/bias contents: storage, version counter, dtype, device."""
        return tuple(_tensor_stamp(t) for t in (self.weight, self.bias) if t is not None)

    def set_outlier_channels(self, channels: torch.Tensor | None) -> None:
        """Keep the input ``channels`` (``[k]`` indices) in the layer's dtype; None quantizes every channel.

        The quantized caches are re-derived on the next forward (or :meth:`refresh`), unless the channels are
        the ones already kept (restoring a calibration, a sync that picks the same set). See :mod:`.outliers`.
        """
        if channels is not None:
            channels = torch.as_tensor(channels).detach()
            if channels.dim() != 1 or channels.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"channels must be a 1-D integer tensor, got {channels.dtype} {tuple(channels.shape)}"
                )
            channels = channels.long().unique()  # sorted, no repeats
            if channels.numel() and not 0 <= int(channels[0]) <= int(channels[-1]) < self.in_features:
                raise ValueError(f"channels must lie in [0, {self.in_features}), got {channels.tolist()}")
            if self.recipe.ocs_ratio > 0:
                raise ValueError(
                    f"recipe {self.recipe.name!r} splits outlier channels itself (ocs_ratio={self.recipe.ocs_ratio}); "
                    "it cannot also keep channels in high precision"
                )
            channels = channels.to(self.weight.device)
        channels = channels if channels is not None and channels.numel() else None
        current = self.outlier_channels
        if (channels is None and current is None) or (
            channels is not None and current is not None and torch.equal(channels, current)
        ):
            return  # the caches already hold this split
        self.outlier_channels = channels
        self._stamp = None  # re-derive the caches

    def _main_weight(self) -> torch.Tensor:
        """The weight the recipe quantizes: ``weight`` with the outlier columns zeroed.  # [N, K]"""
        if self.outlier_channels is None:
            return self.weight
        return self.weight.index_fill(1, self.outlier_channels, 0.0)

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-quantize the cached weight from ``self.weight`` (call after the weight changed)."""
        r = self.recipe
        weight = self._main_weight()
        if self.outlier_channels is None:
            self.weight_outliers = self._keep = None
        else:
            self.weight_outliers = self.weight.index_select(1, self.outlier_channels)  # [N, k]
            keep = torch.ones(self.in_features, dtype=self.weight.dtype, device=self.weight.device)
            self._keep = keep.index_fill_(0, self.outlier_channels, 0.0)  # [K]
        if self.backend == "emulate" and r.ocs_ratio > 0:
            split = ocs_split(
                weight,
                ratio=r.ocs_ratio,
                fmt=r.weight_fmt,
                scaling=r.weight_scaling,
                block=r.weight_block,
            )
            self.weight_fq = split.dequantized()  # [N, K + S]
            self.ocs_index, self.ocs_channels = split.index, split.channels
        elif self.backend == "emulate":
            self.weight_fq = fake_quantize(
                weight, r.weight_fmt, r.weight_scaling, r.weight_block, name="weight"
            )
            self.ocs_index = self.ocs_channels = None
        elif self.backend == "int8":
            self.weight_q_t, self.weight_q_scale = int8_weight_operands(weight)
        elif self.backend == "fbgemm":
            self.weight_fbgemm = fbgemm_weight_operands(weight)
        else:  # fp8_gemm
            self.weight_q_t, self.weight_q_scale = fp8_gemm_weight_operands(weight, r)
        self._stamp = self._current_stamp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_range is not None:  # an OutlierCalibration observes this layer
            self.input_range.update(x)
            if self.input_range.bypass:
                return F.linear(x, self.weight, self.bias)
        if self._stamp != self._current_stamp():
            self.refresh()
        x_main = x if self._keep is None else x * self._keep.to(x.dtype)  # [..., K], outlier columns zeroed
        y = self._quantized_forward(x_main)
        if self.outlier_channels is not None:  # + x[:, out] W[:, out]^T in high precision
            x_out = x.index_select(-1, self.outlier_channels)  # [..., k]
            if torch.is_grad_enabled() and self.weight.requires_grad:
                return y + F.linear(x_out, self.weight.index_select(1, self.outlier_channels))
            w_out_t = self.weight_outliers.t()  # [k, N]
            flat = torch.addmm(y.reshape(-1, y.shape[-1]), x_out.reshape(-1, x_out.shape[-1]), w_out_t)
            return flat.view(y.shape)
        return y

    def _quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The recipe's quantized linear of ``x [..., K]`` (outlier columns already zeroed)."""
        r = self.recipe
        if self.backend == "int8":
            return int8_linear(x, self.weight_q_t, self.weight_q_scale, self.bias)
        if self.backend == "fbgemm":
            return fbgemm_linear(x, self.weight_fbgemm, self.bias)
        if self.backend == "fp8_gemm":
            return scaled_mm_linear(
                x, self.weight_q_t, self.weight_q_scale, self.bias, r.act_fmt, r.act_scaling
            )
        w = self.weight_fq
        if self.ocs_index is not None:  # [..., K + S]: the split channels' activation columns duplicated
            x = x.index_select(-1, self.ocs_index.to(x.device))
        x_q = x
        if r.act_fmt is not None:
            x_q = fake_quantize(x, r.act_fmt, r.act_scaling, r.act_block, check_finite=False, name="input")
        if torch.is_grad_enabled():  # straight-through estimator: forward quantized, backward identity
            if x.requires_grad:
                x_q = x + (x_q - x).detach()
            if self.weight.requires_grad:
                master = self._main_weight() if self.ocs_index is None else self._naive_split(self.weight)
                w = master + (w - master).detach()
        return F.linear(x_q, w, self.bias)

    def _naive_split(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` split in halves on the OCS layout, differentiably (the STE's backward path).  # [N, K + S]

        The rounding-aware split differs from halves by less than a quantization step; as for the
        rounding itself, the straight-through estimator ignores that difference.
        """
        ch = self.ocs_channels.to(weight.device)
        col_scale = torch.ones(weight.shape[1], dtype=weight.dtype, device=weight.device).index_fill(
            0, ch, 0.5
        )
        return torch.cat([weight * col_scale, weight.index_select(1, ch) * 0.5], dim=1)

    @torch.no_grad()
    def effective_weight(self) -> torch.Tensor:
        """The weight the layer effectively multiplies by, ``[N, K]`` (emulate backend).

        The fake-quantized weight; with OCS, its split columns summed back (``OCSSplit.merge``); with
        outlier channels, their columns exact (the activation of those channels is not quantized either).
        """
        if self.backend != "emulate":
            raise ValueError(f"effective_weight needs backend 'emulate', this layer runs {self.backend!r}")
        if self._stamp != self._current_stamp():
            self.refresh()
        if self.ocs_index is not None:
            return merge_split(self.weight_fq, self.ocs_channels, self.in_features)
        if self.outlier_channels is not None:  # the outlier columns are the exact weight's
            return self.weight_fq.index_copy(1, self.outlier_channels, self.weight_outliers)
        return self.weight_fq

    def extra_repr(self) -> str:
        ocs = f", ocs_split={self.ocs_channels.numel()}" if self.ocs_channels is not None else ""
        out = (
            f", outlier_channels={self.outlier_channels.numel()}" if self.outlier_channels is not None else ""
        )
        return f"{super().extra_repr()}, recipe={self.recipe.name}, backend={self.backend}{ocs}{out}"
