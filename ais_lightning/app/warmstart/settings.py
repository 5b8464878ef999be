"""The warm start's settings (the ``warmstart`` config group's schema) and how ``enabled: auto`` is settled."""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from dataclasses import dataclass
from typing import Any

from ais_lightning.modules.sft import SFTModule

__all__ = ["WarmStartSettings", "resolve_enabled"]

_SFT_DEFAULTS = {
    name: param.default
    for name, param in inspect.signature(SFTModule.__init__).parameters.items()
    if param.default is not param.empty
}
"""The optimizer defaults of ``SFTModule`` (lr, warmup_steps, weight_decay, grad_clip): stated once, there."""


@dataclass
class WarmStartSettings:
    """Every setting of the supervised warm start (the schema of the ``warmstart`` config group).

    See :mod:`ais_lightning.app.warmstart` for the procedure. Every field except ``enabled`` and ``cache_dir`` is
    part of the cache key.
    """

    enabled: bool | str = "auto"
    """Run (or load from the cache) the warm start before RL: ``true``, ``false``, or ``auto`` (the default):
    on when the policy starts from random weights (the built-in models, which know nothing of the task), off
    for a pretrained checkpoint (``policy=local|gguf|smollm2``), which already answers and for which these
    settings, sized for the built-in model, would cost hours of SFT. ``ais-train`` settles ``auto`` from the
    policy option before anything is built (:func:`resolve_enabled`)."""
    steps: int = 500
    """With ``target_band``: the budget of optimizer steps (every step trained counts, also those undone by
    a back-off). Without: exactly this many steps."""
    batch_size: int = 128
    """Prompt/solution pairs per SFT step (also prompts per evaluation batch)."""
    lr: float = _SFT_DEFAULTS["lr"]
    """AdamW learning rate after the warm-up (constant afterwards: the stopping step is not known ahead)."""
    warmup_steps: int = _SFT_DEFAULTS["warmup_steps"]
    """Steps of linear learning-rate warm-up from ``lr / warmup_steps`` to ``lr``."""
    weight_decay: float = _SFT_DEFAULTS["weight_decay"]
    """AdamW weight decay."""
    grad_clip: float = _SFT_DEFAULTS["grad_clip"]
    """Max global gradient norm per step (0 = no clipping)."""
    target_band: list[float] | None = None
    """``[low, high]``: stop at the first evaluation whose greedy accuracy is in the band (inclusive).
    None: train exactly ``steps`` steps."""
    eval_every: int = 10
    """Optimizer steps between two evaluations of greedy accuracy (with ``target_band``)."""
    eval_size: int = 512
    """Held-out prompts the greedy accuracy is measured on (never trained on)."""
    max_new_tokens: int = 32
    """Greedy response length limit in the evaluations (match the RL validation's)."""
    max_backoffs: int = 4
    """How often a segment that jumped over the band may be retried from the last snapshot below it."""
    backoff_factor: float = 0.5
    """Multiplier of the learning rate and of the evaluation interval at each back-off, in (0, 1)."""
    num_threads: int = 1
    """Intra-op threads the SFT and its evaluations run with (the caller's setting is restored after);
    0 = the caller's current setting. Fixed, it makes the weights independent of the run's thread count."""
    seed: int | None = None
    """Data seed of the SFT (which prompts it trains and evaluates on); None = the run's seed. Note the
    initial weights are the caller's: fix the model's init seed too to share one warm start across runs."""
    cache_dir: str | None = None
    """Where warm starts are cached; None = ``$AIS_LIGHTNING_CACHE/warmstart`` or
    ``~/.cache/ais_lightning/warmstart``."""

    def __post_init__(self) -> None:
        if self.enabled not in (True, False, "auto") or not isinstance(self.enabled, (bool, str)):
            raise ValueError(f"WarmStartSettings.enabled must be true, false or auto, got {self.enabled!r}")
        for name in ("steps", "batch_size", "eval_every", "eval_size", "max_new_tokens"):
            _check_int(self, name, minimum=1)
        for name in ("warmup_steps", "max_backoffs", "num_threads"):
            _check_int(self, name, minimum=0)
        if self.seed is not None:
            _check_int(self, "seed", minimum=None)
        for name in ("lr", "weight_decay", "grad_clip", "backoff_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"WarmStartSettings.{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        if self.lr <= 0:
            raise ValueError(f"WarmStartSettings.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"WarmStartSettings.weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip < 0:
            raise ValueError(f"WarmStartSettings.grad_clip must be >= 0 (0 = off), got {self.grad_clip}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"WarmStartSettings.backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.target_band is not None:
            band = list(self.target_band)  # a ListConfig or tuple from a config becomes a plain list
            if len(band) != 2 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in band
            ):
                raise ValueError(
                    f"WarmStartSettings.target_band must be [low, high] (two numbers) or None, got {band!r}"
                )
            low, high = float(band[0]), float(band[1])
            if not 0.0 <= low <= high <= 1.0:
                raise ValueError(
                    f"WarmStartSettings.target_band must satisfy 0 <= low <= high <= 1, got [{low}, {high}]"
                )
            self.target_band = [low, high]
        if self.cache_dir is not None and not isinstance(self.cache_dir, str):
            self.cache_dir = os.fspath(self.cache_dir)

    def key_fields(self) -> dict[str, Any]:
        """The settings that change the result (all but ``enabled`` and ``cache_dir``; seed resolved apart)."""
        return {
            k: v for k, v in dataclasses.asdict(self).items() if k not in ("enabled", "cache_dir", "seed")
        }


def resolve_enabled(enabled: bool | str, starts_pretrained: bool) -> bool:
    """``WarmStartSettings.enabled`` settled for a policy: ``auto`` warm-starts only a policy that does not start
    from pretrained weights (``starts_pretrained``); ``true`` / ``false`` are kept.

    >>> resolve_enabled("auto", starts_pretrained=True), resolve_enabled("auto", starts_pretrained=False)
    (False, True)
    >>> resolve_enabled(True, starts_pretrained=True)
    True
    """
    return (not starts_pretrained) if enabled == "auto" else bool(enabled)


def _check_int(settings: WarmStartSettings, name: str, minimum: int | None) -> None:
    value = getattr(settings, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"WarmStartSettings.{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"WarmStartSettings.{name} must be >= {minimum}, got {value}")
