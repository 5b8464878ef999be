"""QuantLinear: a drop-in ``nn.Linear`` that runs with quantized weights and activations.

Backends:

- ``"emulate"`` (any device): exact quantize-dequantize numerics of the recipe for the weight
  (cached) and the input activation (dynamic, every forward), then an fp32/bf16 ``F.linear``.
  This is how FP8/FP4 rollouts are emulated on CPU (FP8-RL, arXiv 2601.18150; QeRL/QaRL-style
  fake quantization).
- ``"int8"`` (CPU): fbgemm dynamic W8A8 through ``torch.ops.quantized.linear_prepack`` /
  ``linear_dynamic``, the real speed path on this machine. Only with the ``int8`` recipe. The weight
  is quantized exactly like the emulated recipe (per output channel, symmetric); fbgemm quantizes
  the *activation* per tensor, asymmetric uint8 with a 7-bit range (``reduce_range``), not per token,
  so its numerics differ slightly from ``backend="emulate"`` with the int8 recipe.
- ``"fp8_gemm"`` (CUDA): ``torch._scaled_mm`` with E4M3 data and per-tensor or per-row scales
  (recipes ``fp8_tensor``, ``fp8_channel``). Refuses a non-CUDA weight.

Recipes with ``ocs_ratio > 0`` (emulate only) split the weight's outlier input channels at every
refresh (:func:`ais_lightning.quant.ocs.ocs_split`, rounding-aware for the recipe's weight grid) and run
``F.linear(x[..., index], W'_q)``: the split activation columns are duplicated, then quantized with the
recipe's activation scaling on the ``K + S`` columns, as a kernel would see them.
:meth:`QuantLinear.set_recipe` / :func:`switch_recipe` change the recipe of existing layers in place
(the fp32 master ``weight`` is untouched; the caches are re-derived): a progressive precision schedule
(:mod:`.schedule`) walks a model from int8 to int4 to int2 with them.

The module keeps ``weight``/``bias`` as ordinary parameters (the same objects as the wrapped
``nn.Linear``), so ``state_dict`` keys are unchanged and weight sync by ``load_state_dict`` works. The
quantized weight is a cache: call :meth:`QuantLinear.refresh` (or :func:`refresh_quantized`) after
changing the weight. As a safety net, ``forward`` also refreshes when the weight's autograd version
counter or storage changed (in-place ``copy_``/optimizer steps, ``load_state_dict``); writes through
``weight.data`` and in-place writes to inference tensors (no version counter) are invisible to that check.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .ocs import merge_split, ocs_split
from .recipes import QuantRecipe, get_recipe
from .scaling import fake_quantize, quantize

BACKENDS = ("emulate", "int8", "fp8_gemm")
"""Known QuantLinear backends."""

DEFAULT_SKIP = ("embed", "lm_head", "norm")
"""Module-name substrings kept in high precision by :func:`quantize_model` when ``skip=None``."""

FP8_GEMM_RECIPES = ("fp8_tensor", "fp8_channel")
"""Recipes the ``fp8_gemm`` backend supports (per-tensor / per-row scales of ``torch._scaled_mm``)."""


def _quantized_engine_reduce_range() -> bool:
    """fbgemm/x86 engines need a 7-bit activation range (AVX2 vpmaddubsw saturation); others do not."""
    engine = torch.backends.quantized.engine
    if engine == "none":
        raise RuntimeError("backend 'int8' needs a torch quantized engine (fbgemm/x86); none is available")
    return engine in ("fbgemm", "x86")


def int8_prepack(weight: torch.Tensor, bias: torch.Tensor | None):
    """Quantize ``weight [N, K]`` per output channel (symmetric, scale = amax / 127) and prepack it for fbgemm."""
    q = quantize(weight.detach(), "int8", "channel", name="weight")
    n = weight.shape[0]
    with warnings.catch_warnings():  # torch >= 2.10 deprecates quantized-tensor creation; the op still works
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(
            q.data.cpu(), q.scale.reshape(n).double().cpu(), torch.zeros(n, dtype=torch.long), 0
        )
        b = None if bias is None else bias.detach().float().cpu()
        return torch.ops.quantized.linear_prepack(qweight, b)


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
    ``weight_scale``: 0-d (per tensor) or ``[1, N]`` (per output channel) float32.
    ``act_scaling``: ``"tensor"`` (0-d scale) or ``"token"`` (``[M, 1]`` scale).
    Device-agnostic; the CPU kernel is slow and only useful for checking numerics.
    """
    k = x.shape[-1]
    x2d = x.reshape(-1, k)  # [M, K]
    qx = quantize(x2d, fmt, act_scaling, check_finite=False, name="input")
    scale_a = qx.scale.reshape(()) if act_scaling == "tensor" else qx.scale.reshape(-1, 1)  # [] or [M, 1]
    rowwise = scale_a.dim() == 2 or weight_scale.dim() == 2
    out_dtype = torch.bfloat16 if rowwise else torch.float32  # CUDA row-wise scaling requires bf16 output
    y = torch._scaled_mm(
        qx.data.contiguous(), weight_t, scale_a=scale_a, scale_b=weight_scale, out_dtype=out_dtype
    )
    y = y.to(x.dtype)  # [M, N]
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
        layer._setup(recipe, backend)
        return layer

    def _setup(self, recipe: str | QuantRecipe, backend: str) -> None:
        recipe = get_recipe(recipe)
        self._check_backend(recipe, backend)  # before any state changes, so a refused switch changes nothing
        self.recipe = recipe
        self.backend = backend
        # Caches derived from `weight` (plain attributes, not buffers: they are no model state, so they
        # stay out of state dicts and weight syncs; a device move changes the stamp and re-derives them).
        self.weight_fq: torch.Tensor | None = None  # emulate: fake-quantized weight [N, K] (OCS: [N, K + S])
        self.weight_fp8_t: torch.Tensor | None = None  # fp8_gemm: [K, N] col-major
        self.weight_fp8_scale: torch.Tensor | None = None  # fp8_gemm: [] or [1, N]
        self.ocs_index: torch.Tensor | None = None  # emulate + OCS: [K + S] input column of each split column
        self.ocs_channels: torch.Tensor | None = None  # emulate + OCS: [S] split input channels
        self._packed = None  # int8: fbgemm packed params
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
        if recipe.ocs_ratio > 0 and backend != "emulate":
            raise ValueError(
                f"recipe {recipe.name!r} splits outlier channels (ocs_ratio={recipe.ocs_ratio}), which only "
                f"backend 'emulate' runs, got backend {backend!r}"
            )
        if backend == "int8" and recipe.name != "int8":
            raise ValueError(f"backend 'int8' (fbgemm W8A8) only runs the 'int8' recipe, got {recipe.name!r}")
        if backend == "int8" and self.weight.device.type != "cpu":
            raise ValueError(f"backend 'int8' runs on CPU (fbgemm), weight is on {self.weight.device}")
        if backend == "fp8_gemm":
            if recipe.name not in FP8_GEMM_RECIPES:
                raise ValueError(
                    f"backend 'fp8_gemm' supports recipes {FP8_GEMM_RECIPES}, got {recipe.name!r}"
                )
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

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-quantize the cached weight from ``self.weight`` (call after the weight changed)."""
        r = self.recipe
        if self.backend == "emulate" and r.ocs_ratio > 0:
            split = ocs_split(
                self.weight,
                ratio=r.ocs_ratio,
                fmt=r.weight_fmt,
                scaling=r.weight_scaling,
                block=r.weight_block,
            )
            self.weight_fq = split.dequantized()  # [N, K + S]
            self.ocs_index, self.ocs_channels = split.index, split.channels
        elif self.backend == "emulate":
            self.weight_fq = fake_quantize(
                self.weight, r.weight_fmt, r.weight_scaling, r.weight_block, name="weight"
            )
            self.ocs_index = self.ocs_channels = None
        elif self.backend == "int8":
            self._packed = int8_prepack(self.weight, self.bias)
        else:
            q = quantize(self.weight, r.weight_fmt, r.weight_scaling, name="weight")
            self.weight_fp8_t = q.data.t()  # [K, N] column-major view of the row-major [N, K]
            self.weight_fp8_scale = (
                q.scale.reshape(()) if r.weight_scaling == "tensor" else q.scale.reshape(1, -1)
            )
        self._stamp = self._current_stamp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._stamp != self._current_stamp():
            self.refresh()
        r = self.recipe
        if self.backend == "int8":
            reduce_range = _quantized_engine_reduce_range()
            y = torch.ops.quantized.linear_dynamic(x.float().contiguous(), self._packed, reduce_range)
            return y.to(x.dtype)
        if self.backend == "fp8_gemm":
            return scaled_mm_linear(
                x, self.weight_fp8_t, self.weight_fp8_scale, self.bias, r.act_fmt, r.act_scaling
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
                master = self.weight if self.ocs_index is None else self._naive_split(self.weight)
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

        The fake-quantized weight; with OCS, its split columns summed back (``OCSSplit.merge``).
        """
        if self.backend != "emulate":
            raise ValueError(f"effective_weight needs backend 'emulate', this layer runs {self.backend!r}")
        if self._stamp != self._current_stamp():
            self.refresh()
        if self.ocs_index is None:
            return self.weight_fq
        return merge_split(self.weight_fq, self.ocs_channels, self.in_features)

    def extra_repr(self) -> str:
        ocs = f", ocs_split={self.ocs_channels.numel()}" if self.ocs_channels is not None else ""
        return f"{super().extra_repr()}, recipe={self.recipe.name}, backend={self.backend}{ocs}"


def quantize_model(
    model: nn.Module, recipe: str | QuantRecipe, backend: str = "emulate", skip: Iterable[str] | None = None
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`QuantLinear`; returns ``model``.

    ``skip``: module-name substrings to keep in high precision; None means :data:`DEFAULT_SKIP`
    (embeddings, ``lm_head`` and norms, the usual FP8 rollout practice, e.g. FP8-RL arXiv 2601.18150);
    ``[]`` quantizes every linear. Layers that are already QuantLinear are left alone.
    """
    if isinstance(skip, str):
        raise ValueError(f"skip must be a list of name substrings, not a single string {skip!r}")
    skip = DEFAULT_SKIP if skip is None else tuple(skip)
    recipe = get_recipe(recipe)
    if isinstance(model, nn.Linear):
        raise ValueError("model is itself an nn.Linear; use QuantLinear.from_linear for a single layer")
    targets = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and not isinstance(module, QuantLinear)
        and not any(s in name for s in skip)
    ]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_linear(getattr(parent, child), recipe, backend))
    return model


def refresh_quantized(model: nn.Module) -> int:
    """Call :meth:`QuantLinear.refresh` on every QuantLinear in ``model``; returns how many were refreshed."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for layer in layers:
        layer.refresh()
    return len(layers)


def switch_recipe(
    model: nn.Module,
    recipe: str | QuantRecipe,
    backend: str | None = None,
    names: Iterable[str] | None = None,
) -> int:
    """Switch the :class:`QuantLinear` layers of ``model`` to ``recipe`` in place; returns how many.

    The fp32 master weights (``weight``/``bias`` Parameters, the state dict, optimizer state) are
    untouched; only the quantized caches are re-derived, so a trainer can lower the precision mid-run
    (:class:`ais_lightning.quant.schedule.PrecisionSchedule`). ``backend``: None keeps each layer's.
    ``names``: module-name substrings selecting the layers to switch (None = all), e.g. one decoder
    block at a time. Every layer is checked before any is switched: an incompatible recipe/backend
    raises ValueError and leaves the model unchanged.
    """
    if isinstance(names, str):
        raise ValueError(f"names must be a list of name substrings, not a single string {names!r}")
    recipe = get_recipe(recipe)
    selected = tuple(names) if names is not None else None
    layers = [
        m
        for n, m in model.named_modules()
        if isinstance(m, QuantLinear) and (selected is None or any(s in n for s in selected))
    ]
    for layer in layers:
        layer._check_backend(recipe, layer.backend if backend is None else backend)
    for layer in layers:
        layer.set_recipe(recipe, backend)
    return len(layers)
