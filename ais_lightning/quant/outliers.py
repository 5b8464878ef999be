"""Outlier input channels kept in high precision, picked from calibrated activation ranges.

Real LLMs have a few input channels whose activations are orders of magnitude larger than the rest
(outlier features, Dettmers et al. 2022, LLM.int8(), arXiv 2208.07339; massive activations, Sun et al.
2024, arXiv 2402.17762). Per-token activation quantization then spends its whole range on them: the
step ``amax_row / 127`` that one outlier channel sets is too coarse for every other channel of the token,
and the weight error of those columns is multiplied by the largest activations. LLM.int8() computes the
outlier columns in 16 bits and the rest in int8 (a mixed-precision decomposition); here the outlier set is
static between weight syncs, calibrated on the activations the layer actually saw:

    y = Q(x * keep) Q(W * keep)^T + x[:, out] W[:, out]^T + b      # keep = 1 except at the outlier channels

The first term is the layer's recipe (int8, FP8, ...) on the other channels, with the outlier columns
zeroed in place (the blocks along K keep their layout); the second is a small high-precision GEMM over
``k = ceil(fraction * K)`` columns. Channels are ranked by their calibrated ``max |x|`` alone: the per-token
step is set by the largest channel of each token, and a column's weight error reaches the output scaled
by that channel's activation, so the channels with the largest activations are the ones both errors come
from. On SmolLM2-135M (docs/real_model.md) 10% of the channels take the int8 mismatch from 4e-2 to 4e-3 nats.

- :func:`largest_channels`: the ``n`` channels of a range vector with the largest values (also used by
  outlier channel splitting, :mod:`.ocs`, on weight ranges).
- :class:`InputRange`: a per-layer observer of ``max |x|`` per input channel.
- :class:`OutlierCalibration`: observes a set of :class:`~ais_lightning.quant.QuantLinear` layers during
  forwards the caller runs, then sets each layer's outlier channels (``QuantLinear.set_outlier_channels``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn


def largest_channels(amax: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` entries of ``amax [K]`` with the largest values, as ascending indices.  # [n]

    Ties go to the lower index (stable sort), so the choice is deterministic.
    """
    if amax.dim() != 1:
        raise ValueError(f"amax must be 1-D [K], got shape {tuple(amax.shape)}")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= amax.shape[0]:
        raise ValueError(f"n must be an int in [0, {amax.shape[0]}], got {n!r}")
    order = torch.argsort(amax.float(), descending=True, stable=True)[:n]
    return order.sort().values


def outlier_count(in_features: int, fraction: float) -> int:
    """How many of ``in_features`` channels a ``fraction`` keeps in high precision: ``ceil(fraction * K)``."""
    check_fraction(fraction)
    return min(in_features, math.ceil(round(fraction * in_features, 9)))  # round: 0.1 * 640 is 64.000...01


def check_fraction(fraction: float, name: str = "outlier_fraction") -> float:
    """``fraction`` as a float in [0, 1); ValueError naming ``name`` otherwise."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {fraction!r}")
    return float(fraction)


class InputRange:
    """Running ``max |x|`` per input channel of one layer (``amax [K]``, float32), and whether the layer
    should skip its quantization while observed (``bypass``: calibrate on unquantized activations)."""

    def __init__(self, in_features: int, bypass: bool = False) -> None:
        self.in_features = in_features
        self.bypass = bypass
        self.amax: torch.Tensor | None = None

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold the activations ``x [..., K]`` into the running maximum."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} channels, the layer has {self.in_features}")
        if x.numel() == 0:
            return
        amax = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()  # [K]
        self.amax = amax if self.amax is None else torch.maximum(self.amax, amax)


class OutlierCalibration:
    """Keeps the ``fraction`` of every layer's input channels with the largest observed range in high precision.

    ``layers``: :class:`~ais_lightning.quant.QuantLinear` modules (each is calibrated on its own input).
    The owner runs forwards inside :meth:`observe` and calls :meth:`apply` when the layers may change
    (e.g. at a weight sync); :meth:`apply` only sets the channels (each layer re-quantizes lazily on its
    next forward, or when the owner refreshes it). Until the first :meth:`apply`, :attr:`calibrated` is
    False and the layers quantize every channel.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from ais_lightning.quant import QuantLinear, OutlierCalibration
        >>> layer = QuantLinear.from_linear(nn.Linear(64, 8), "int8")
        >>> calibration = OutlierCalibration([layer], fraction=0.05)
        >>> x = torch.randn(16, 64); x[:, 3] *= 100  # one outlier channel
        >>> with calibration.observe(bypass=True):
        ...     _ = layer(x)
        >>> calibration.apply()  # the number of layers set
        1
        >>> 3 in layer.outlier_channels.tolist()  # ceil(0.05 * 64) = 4 channels, channel 3 among them
        True
    """

    def __init__(self, layers: Iterable[nn.Module], fraction: float) -> None:
        self.fraction = check_fraction(fraction)
        self.layers = list(layers)
        self.calibrated = False
        self._ranges: dict[int, InputRange] = {}

    @contextlib.contextmanager
    def observe(self, bypass: bool = False) -> Iterator[None]:
        """Record every layer's input range during the forwards run inside; ``bypass``: the layers run
        unquantized meanwhile (a calibration pass whose outputs are discarded)."""
        observers = []
        for layer in self.layers:
            observer = self._ranges.get(id(layer))
            if observer is None:
                observer = self._ranges[id(layer)] = InputRange(layer.in_features)
            observer.bypass = bypass
            layer.input_range = observer
            observers.append(observer)
        try:
            yield
        finally:
            for layer in self.layers:
                layer.input_range = None

    def apply(self) -> int:
        """Set each observed layer's outlier channels from its range, then start a new observation window.

        Layers not observed since the last call keep their channels. Returns how many layers were set.
        """
        n_set = 0
        for layer in self.layers:
            observer = self._ranges.get(id(layer))
            if observer is None or observer.amax is None:
                continue
            n = outlier_count(layer.in_features, self.fraction)
            layer.set_outlier_channels(largest_channels(observer.amax, n))
            n_set += 1
        self._ranges.clear()
        self.calibrated = self.calibrated or n_set > 0
        return n_set

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume exactly: each layer's channels (``[k]`` or None), the ranges
        observed since the last :meth:`apply` (``[K]`` or None), in the order of ``layers``."""
        ranges = [self._ranges.get(id(layer)) for layer in self.layers]
        return {
            "fraction": self.fraction,
            "calibrated": self.calibrated,
            "channels": [
                None if layer.outlier_channels is None else layer.outlier_channels.clone()
                for layer in self.layers
            ],
            "ranges": [None if r is None or r.amax is None else r.amax.clone() for r in ranges],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s channels and ranges on the same layers; ValueError if they differ."""
        channels, ranges = state.get("channels"), state.get("ranges")
        if state.get("fraction") != self.fraction or not (
            isinstance(channels, list)
            and isinstance(ranges, list)
            and len(channels) == len(ranges) == len(self.layers)
        ):
            raise ValueError(
                f"outlier calibration state for fraction {state.get('fraction')!r} and "
                f"{len(channels) if isinstance(channels, list) else '?'} layers does not fit this one "
                f"(fraction {self.fraction}, {len(self.layers)} layers)"
            )
        for layer, amax in zip(self.layers, ranges):
            if amax is not None and amax.shape != (layer.in_features,):
                raise ValueError(
                    f"outlier range of shape {tuple(amax.shape)} for a layer of {layer.in_features} inputs"
                )
        for layer, kept in zip(self.layers, channels):
            layer.set_outlier_channels(kept)
        self._ranges = {}
        for layer, amax in zip(self.layers, ranges):
            if amax is not None:
                observer = self._ranges[id(layer)] = InputRange(layer.in_features)
                observer.amax = amax.clone()
        self.calibrated = bool(state.get("calibrated"))
