"""IcePop: importance weights set to 0 outside [c_low, c_high], while the tokens stay in the denominator.

IcePop (the Ling team's Ring-1T report, arXiv 2510.18855, cited by TRL's ``docs/source/paper_index.md``
under "Masked Importance Sampling") as shipped by slime (``slime/backends/megatron_utils/loss.py``,
``icepop_function``): ``ice_weight = ratio if tis_clip_low <= ratio <= tis_clip else 0`` multiplies the
per-token policy loss and the ``loss_masks`` are returned unchanged. TRL's ``vllm_importance_sampling_mode=
"token_mask"`` / ``"sequence_mask"`` (``trl/trainer/grpo_trainer.py``) is the same operation (ratios
outside [C_min, C_max] are ``masked_fill``-ed with 0, ``completion_mask`` untouched); TRL's docs and
tests name (C_min, C_max) = (0.5, 5.0) "IcePop", our defaults.

IcePop versus MIS (``ais_lightning.correctors.MIS``), both keep weight w inside the band:

- MIS removes an out-of-band token from the loss *and from its denominator* (``out.mask`` False):
  with token-mean aggregation the survivors are averaged among themselves, so the loss keeps its
  per-token scale however many tokens are rejected (and a batch with many rejections gives each
  survivor more weight).
- IcePop zeroes the weight but keeps the token in the denominator (``out.mask`` True, weight 0): the
  loss is sum_kept(w l) / N_all, i.e. MIS's loss times N_kept / N_all. Rejections shrink the
  gradient (an implicit, batch-dependent learning-rate cut) instead of being renormalised away; with
  ``seq-mean-token-mean`` a fully rejected response still counts as one (zero) response.
"""

from __future__ import annotations

import torch

from ais_lightning.correctors.ais import AISParams, ais_params
from ais_lightning.correctors.base import Corrector, RawCorrection, check_bounds, check_level, level_ratio


class IcePop(Corrector):
    """weight = w_level if c_low <= w_level <= c_high else 0; every valid token stays in the mask.

    Args:
        level: ``"token"`` (IcePop, slime ``icepop_function``, TRL ``token_mask``), ``"sequence"``
            (TRL ``sequence_mask``: the product of the token ratios) or ``"geometric"``.
        c_low: lower band edge alpha in [0, 1] (slime ``--tis-clip-low``, TRL ``C_min``).
        c_high: upper band edge beta >= 1 (slime ``--tis-clip``, TRL ``C_max``).

    ``corrector/masked_frac`` is always 0 (nothing leaves the denominator); the zeroed tokens are
    counted in ``corrector/clipped_frac`` and in the extra stat ``icepop/zeroed_frac``.
    """

    def __init__(self, level: str = "token", c_low: float = 0.5, c_high: float = 5.0) -> None:
        super().__init__()
        check_level(level)
        check_bounds(c_low, c_high)
        self.level = level
        self.c_low = float(c_low)
        self.c_high = float(c_high)

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> RawCorrection:
        ratio = level_ratio(delta, mask, self.level)  # [B, T]
        inside = (ratio >= self.c_low) & (ratio <= self.c_high)  # [B, T]
        weights = torch.where(inside, ratio, torch.zeros_like(ratio))  # [B, T]
        zeroed = mask & ~inside  # [B, T]
        frac = zeroed.sum().double() / mask.sum().clamp(min=1).double()
        return RawCorrection(weights, mask, zeroed, {"icepop/zeroed_frac": frac})

    def diagnostic_params(self) -> AISParams:
        """C = ``c_high``, the lower bound ``c_low`` (:meth:`Corrector.diagnostic_params`)."""
        return ais_params(c=self.c_high, c_low=self.c_low, base="mis")

    def extra_repr(self) -> str:
        return f"level={self.level!r}, c_low={self.c_low}, c_high={self.c_high}"
