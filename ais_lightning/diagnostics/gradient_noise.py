"""The gradient noise scale of a batch, from the gradients of its independent units.

McCandlish, Kaplan, Amodei et al., *An Empirical Model of Large-Batch Training* (arXiv 1812.06162),
section 2: with ``G`` the true gradient and ``Σ`` the covariance of one unit's gradient, a batch of ``B``
units has ``E|Ĝ_B - G|² = tr(Σ) / B``, and the *simple noise scale* ``B_noise = tr(Σ) / |G|²`` is the
batch size at which the batch gradient's noise equals its signal. AIS v2's ``noise_to_signal``
(``φ = Var(Ĝ)/|g|²``, docs/ais.md section 6) is ``B_noise / B``.

For GRPO the independent unit is a prompt's group of responses (its advantages are normalised within
the group), and a unit's gradient is scaled so that the batch gradient is the plain mean of the units'
(``tools/gradient_noise.py`` does both).

The optimizer does not apply one batch's gradient: Adam's first moment is an exponential average of
the step gradients. Over that average the independent noise of successive batches shrinks by
``averaged_noise_factor(beta1)`` (``ais_lightning.correctors.ais``, re-exported here) while a bias that
persists from step to step (the rollout's mismatch) does not, so the noise-to-signal ratio of the update
is ``φ · averaged_noise_factor(beta1)``: what AIS v2 uses with ``momentum = beta1`` (and with the
trainer's ``ppo_epochs`` and ``mini_batches`` when a rollout batch takes several optimizer steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ais_lightning.correctors.ais import averaged_noise_factor

__all__ = ["GradientNoise", "averaged_noise_factor", "gradient_noise_scale"]


@dataclass(frozen=True)
class GradientNoise:
    """Unbiased estimates from ``units`` unit gradients."""

    trace: float
    """tr(Σ): the summed variance of one unit's gradient over the parameters."""
    signal_sq: float
    """|G|²: the squared norm of the true gradient (``|mean|² - tr(Σ)/units``; may be <= 0 when noise dominates)."""
    units: int

    @property
    def noise_scale(self) -> float:
        """``B_noise = tr(Σ) / |G|²`` in units (inf when the signal estimate is not positive)."""
        return self.trace / self.signal_sq if self.signal_sq > 0 else float("inf")

    def noise_to_signal(self, batch_units: int) -> float:
        """``φ = tr(Σ) / (B |G|²)`` for a batch of ``batch_units`` units: AIS v2's ``noise_to_signal``."""
        if batch_units < 1:
            raise ValueError(f"batch_units must be >= 1, got {batch_units}")
        return self.noise_scale / batch_units


def gradient_noise_scale(unit_grads: torch.Tensor) -> GradientNoise:
    """tr(Σ) and |G|² from ``unit_grads`` ``[U, P]``: U >= 2 independent draws of a unit's gradient.

    ``tr(Σ) = Σ_u |g_u - ḡ|² / (U - 1)`` (unbiased), ``|G|² = |ḡ|² - tr(Σ) / U`` (unbiased, since
    ``E|ḡ|² = |G|² + tr(Σ)/U``). Computed in float64.
    """
    if unit_grads.dim() != 2 or unit_grads.shape[0] < 2:
        raise ValueError(f"unit_grads must be [U, P] with U >= 2 units, got shape {tuple(unit_grads.shape)}")
    if not torch.isfinite(unit_grads).all():
        raise ValueError("unit_grads holds non-finite values")
    g = unit_grads.double()
    units = g.shape[0]
    mean = g.mean(0)  # [P]
    trace = float((g - mean).pow(2).sum() / (units - 1))
    signal_sq = float(mean.pow(2).sum()) - trace / units
    return GradientNoise(trace=trace, signal_sq=signal_sq, units=units)
