"""Rounding-aware outlier channel splitting (OCS) of a linear layer's input channels.

**OCS** (Zhao et al., "Improving Neural Network Quantization without Retraining using Outlier Channel
Splitting", ICML 2019, arXiv 1901.09504; reference code ``cornell-zhang/dnn-quant-ocs``,
``distiller/quantization/ocs_impl.py``, ``ocs_wts``): ``y = x W^T`` is unchanged if an input channel
``k`` is duplicated (activation column ``x_k`` copied) and its weight column ``w`` replaced by two
columns ``a``, ``b`` with ``a + b = w``. Splitting the columns that hold the outlier weights halves
their magnitude, so the blocks that contained them get a smaller scale and a finer grid for all their
other weights. Bit-by-Bit (Xu et al., ACL 2026, arXiv 2604.07888) uses a *rounding-aware* split "which
mitigates quantization error while acting as an identity transform that preserves the quantized
outputs"; only its abstract is available to us, so the rule below is ours, built on OCS's
quantization-aware split (``grid_aware=True`` in ``ocs_wts``: halves ``w/2 -+ Delta/4``, whose roundings
sum to the rounding of ``w``).

**Layout** (what a kernel sees). ``W' = [W with column k replaced by a  |  b for each split k]``, shape
``[N, K + S]``; ``index = [0, 1, ..., K-1, k_1, ..., k_S]`` (``[K + S]``), the activation column feeding
each column of ``W'``; the layer computes ``F.linear(x[..., index], W')``. The original columns keep
their positions (and their groups along K); the ``b`` pieces form a tail (own groups when
``K`` is a multiple of the group size; a kernel pads the tail to a whole group).

**Which channels.** The ``S`` input channels with the largest ``max |w|`` over output rows, ``S =
ceil(ratio * K)`` as in ``ocs_wts``. Each channel is split at most once (``ocs_wts`` re-ranks after every
split and may split a half again; once keeps exactly two pieces per channel, so the split and its
inverse :meth:`OCSSplit.merge` stay exact).

**Plain split** (``fmt=None``): ``a = w/2``, ``b = w - a``, and ``a + b == w`` bit for bit.

**Rounding-aware split** (``fmt`` an integer format: ``int8``, ``nint8``/``nint4``/``nint2``). The scales are
planned first: the naive split (halves ``w/2``) is quantized with the layer's scaling, which fixes a
scale ``s_a`` for piece ``a`` (its block in the original column's group) and ``s_b`` for ``b`` (its tail
block), per output row. Then, coarse piece first (``s_hi = max(s_a, s_b)``, ``s_lo`` the other):

    L_hi = Q_hi(w / 2)          # the level the coarse piece takes
    L_lo = Q_lo(w - L_hi)       # the fine piece carries what the coarse one missed (error feedback)
    r    = w - L_hi - L_lo      # |r| <= s_lo / 2 unless saturated
    a, b = L_a + r s_a / (s_a + s_b),  L_b + r s_b / (s_a + s_b)      # a + b = w

Each piece then sits at most a quarter step from its level (``|r| s_hi / (s_a + s_b) <= s_hi / 4``, and
``s_lo^2 / (2 (s_a + s_b)) <= s_lo / 4``), so quantizing ``W'`` with the planned scales gives exactly the
levels ``L_a``, ``L_b`` (robust to the FP32 rounding of the pieces), and the split weight represents
``w`` by ``L_a + L_b``, within ``s_lo / 2 <= s_hi / 2`` of ``w``: at least as fine as the unsplit grid.
When ``s_a = s_b = s`` this is OCS's quantization-aware split: the pieces' levels sum to the correctly
rounded ``w`` on the step-``s`` grid with zero (``L_a + L_b = (c_a + c_b + 1) s`` on a nested grid), i.e.
the outlier channel gains one bit of range and the quantized output of the pair equals that of ``w``
quantized on that grid. The planned scales are those of the naive split and are kept
(:func:`ais_lightning.quant.scaling.quantize_with_scales`); re-deriving them from ``W'``'s amax could
differ slightly because the pieces move by up to 3/4 of a step from ``w/2``.

**Exactness in FP32.** The larger piece ``p`` is computed and the other is ``w - p``. Where both pieces
have ``w``'s sign (every entry more than about a step from 0, e.g. all outliers), ``|w|/2 <= |p| <= |w|``
and ``w - p`` is exact (Sterbenz's lemma), so ``a + b == w`` bit for bit. Near 0 the best pieces can
have opposite signs (e.g. ``+s/2`` and ``w - s/2`` on a nested grid, whose sum should round to 0); then
``w - p`` has more than 24 significant bits in general and is rounded once: ``|a + b - w| <= 2^-24 |b|``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .formats import NumberFormat, get_format
from .outliers import largest_channels
from .scaling import QuantizedTensor, dequantize, quantize, quantize_with_scales


@dataclass
class OCSSplit:
    """A split linear weight: ``F.linear(x[..., index], weight) == F.linear(x, original)``."""

    weight: torch.Tensor
    """``[N, K + S]``: the original columns (split ones hold piece ``a``), then the ``b`` pieces."""
    index: torch.Tensor
    """``[K + S]`` long: the input (activation) column feeding each column of ``weight``."""
    channels: torch.Tensor
    """``[S]`` long, ascending: the split input channels (``index[K:]``)."""
    in_features: int
    """``K``, the original number of input channels."""
    quantized: QuantizedTensor | None = None
    """Rounding-aware splits: ``weight`` quantized with the planned scales; None for a plain split."""

    @property
    def n_split(self) -> int:
        return int(self.channels.numel())

    def expand_input(self, x: torch.Tensor) -> torch.Tensor:
        """Duplicate the split activation columns: ``x [..., K] -> [..., K + S]``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must have {self.in_features} features in its last dim, got {tuple(x.shape)}")
        return x.index_select(-1, self.index.to(x.device))

    def merge(self, t: torch.Tensor | None = None) -> torch.Tensor:
        """Sum each split channel's two columns back: ``[N, K + S] -> [N, K]`` (default: ``weight``).

        ``merge(dequantize(quantized))`` is the effective quantized weight of the original layer.
        """
        return merge_split(self.weight if t is None else t, self.channels, self.in_features)

    def dequantized(self) -> torch.Tensor:
        """The quantized split weight ``[N, K + S]`` (rounding-aware splits only)."""
        if self.quantized is None:
            raise ValueError("this split has no quantization (it was made with fmt=None)")
        return dequantize(self.quantized)


def merge_split(t: torch.Tensor, channels: torch.Tensor, in_features: int) -> torch.Tensor:
    """Sum the tail columns of a split ``t [N, K + S]`` into their channels: ``[N, K]`` (one add each)."""
    k, s = in_features, int(channels.numel())
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != k + s:
        raise ValueError(
            f"t must be a [N, {k + s}] tensor (K={k} + S={s} split columns), got {tuple(t.shape)}"
        )
    out = t[:, :k].clone()  # [N, K]
    ch = channels.to(t.device)
    out[:, ch] = out[:, ch] + t[:, k:]
    return out


def n_split_channels(in_features: int, ratio: float) -> int:
    """``ceil(ratio * in_features)``, the number of channels OCS splits (``ocs_wts``' expand ratio)."""
    if not (isinstance(ratio, (int, float)) and 0.0 <= ratio <= 1.0) or isinstance(ratio, bool):
        raise ValueError(f"ratio must be a number in [0, 1], got {ratio!r}")
    return min(in_features, math.ceil(ratio * in_features))


def select_outlier_channels(weight: torch.Tensor, n_split: int) -> torch.Tensor:
    """The ``n_split`` input channels of ``weight [N, K]`` with the largest ``max |w|``, ascending.  # [S]

    Ties go to the lower channel index (stable sort), so the choice is deterministic.
    """
    _check_weight(weight)
    if not isinstance(n_split, int) or isinstance(n_split, bool) or not 0 <= n_split <= weight.shape[1]:
        raise ValueError(f"n_split must be an int in [0, {weight.shape[1]}], got {n_split!r}")
    amax = weight.detach().abs().amax(dim=0) if weight.shape[0] else weight.new_zeros(weight.shape[1])  # [K]
    return largest_channels(amax, n_split)


def ocs_split(
    weight: torch.Tensor,
    *,
    ratio: float | None = None,
    n_split: int | None = None,
    fmt: str | NumberFormat | None = None,
    scaling: str = "group_e4m3",
    block: int | tuple[int, int] | None = None,
) -> OCSSplit:
    """Split the outlier input channels of ``weight [N, K]`` (module docstring); weights in, split out.

    Give exactly one of ``ratio`` (fraction of ``K``, rounded up) or ``n_split``. ``fmt=None``: plain
    halving. ``fmt`` = an integer format (``int8``, ``nint8``, ``nint4``, ``nint2``): rounding-aware for the
    quantizer ``(fmt, scaling, block)`` (the layer's weight recipe), and ``quantized`` holds the split
    weight's quantization. Computed in FP32 (exactness statements hold there); ``weight`` and the
    returned tensors have ``weight``'s dtype. Meant for weight-sync time: no gradient is tracked.
    """
    _check_weight(weight)
    n, k = weight.shape
    if (ratio is None) == (n_split is None):
        raise ValueError(f"give exactly one of ratio or n_split, got ratio={ratio!r}, n_split={n_split!r}")
    s = n_split_channels(k, ratio) if ratio is not None else n_split
    f = None if fmt is None else get_format(fmt)
    if f is not None and not f.is_uniform:
        raise ValueError(
            f"fmt must be an integer format (int8, nint8, nint4, nint2) for a rounding-aware split, got {f.name!r}; "
            f"use fmt=None for a plain split"
        )
    with torch.no_grad():
        w32 = weight.detach().float()  # [N, K]
        channels = select_outlier_channels(w32, s)  # [S]
        cols = w32[:, channels]  # [N, S]
        half = cols * 0.5
        quantized = None
        if f is None:
            a, b = half, cols - half
        else:
            naive = torch.cat([w32.index_copy(1, channels, half), half], dim=1)  # [N, K + S]
            plan = quantize(naive, f, scaling, block, name="weight")
            step = _element_scale(plan, naive.shape)  # [N, K + S]
            a, b = rounding_aware_pieces(cols, step[:, channels], step[:, k:], f)
        split = torch.cat([w32.index_copy(1, channels, a), b], dim=1)  # [N, K + S]
        if f is not None:
            quantized = quantize_with_scales(split, plan, name="split weight")
            quantized.dtype = weight.dtype
        index = torch.cat([torch.arange(k, device=weight.device), channels])  # [K + S]
    return OCSSplit(split.to(weight.dtype), index, channels, k, quantized)


def rounding_aware_pieces(
    w: torch.Tensor, s_a: torch.Tensor, s_b: torch.Tensor, fmt: str | NumberFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pieces ``a``, ``b`` of ``w`` for an integer grid with steps ``s_a``, ``s_b`` (module docstring).

    All arguments broadcast together (float32, steps >= 0; a 0 step is an all-zero block, which
    quantizes to 0 whatever it holds). Returns ``(a, b)`` with ``a + b = w`` (exact where both share
    ``w``'s sign, else up to one rounding of ``b``), ``a`` quantizing to ``L_a`` on step ``s_a`` and ``b``
    to ``L_b`` on ``s_b``, ``|L_a + L_b - w| <= min(s_a, s_b) / 2`` unless the grid saturates.
    """
    f = get_format(fmt)
    if not f.is_uniform:
        raise ValueError(f"fmt must be an integer format, got {f.name!r}")
    hi_is_a = s_a >= s_b
    s_hi = torch.where(hi_is_a, s_a, s_b)
    s_lo = torch.where(hi_is_a, s_b, s_a)
    level_hi = f.round(w * 0.5 / _nonzero(s_hi)) * s_hi  # the coarse piece's level
    carry = w - level_hi  # what the fine piece must represent
    level_lo = f.round(carry / _nonzero(s_lo)) * s_lo
    r = carry - level_lo  # merged rounding error
    total = s_hi + s_lo
    theta_hi = torch.clamp(r * s_hi / _nonzero(total), min=-0.25 * s_hi, max=0.25 * s_hi)
    p_hi = level_hi + theta_hi
    p_lo = level_lo + (r - theta_hi)
    p_a = torch.where(hi_is_a, p_hi, p_lo)
    p_b = torch.where(hi_is_a, p_lo, p_hi)
    a_is_big = p_a.abs() >= p_b.abs()  # compute the larger piece, take the other as w minus it
    a = torch.where(a_is_big, p_a, w - p_b)
    b = torch.where(a_is_big, w - p_a, p_b)
    return a, b


def _nonzero(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.ones_like(s), s)


def _element_scale(q: QuantizedTensor, shape: torch.Size) -> torch.Tensor:
    """The effective scale of every element of a 2-D quantized tensor.  # [M, K]"""
    bm, bk = q.block
    m, k = shape
    return q.effective_scale().repeat_interleave(bm, 0).repeat_interleave(bk, 1)[:m, :k]


def _check_weight(weight: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2-D floating-point [N, K] tensor, got "
            f"{getattr(weight, 'dtype', type(weight))} of shape {tuple(getattr(weight, 'shape', ()))}"
        )
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight has non-finite values (nan/inf); cannot split it")
