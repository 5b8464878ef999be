"""M2PO's adaptive second-moment mask: drop the tokens with the largest (log ratio)^2 until the mean is small.

M2PO ("Second-Moment Trust Policy Optimization", Zheng et al., arXiv 2510.01161) as AReaL implements
it (``areal/trainer/ppo/actor.py``, ``_apply_m2po_masking`` / ``_get_m2po_loss_mask``; documented in
AReaL's ``docs/en/algorithms/m2po.md``): with m2 = (log pi_prox - log pi_behav)^2 over the loss-mask tokens
(here pi_prox = pi_old, pi_behav = mu, so m2 = delta^2), sorted in descending order, the k largest
are masked where k is the first index whose suffix mean mean(sorted[k:]) is *strictly* below the
threshold tau (``actor.m2_threshold``; 0.04 in ``examples/math/gsm8k_m2po.yaml``). If no suffix mean is
below tau, all but the smallest are masked. Masked tokens leave the loss and its denominator
(AReaL rewrites ``loss_mask``). Kept tokens carry AReaL's decoupled-loss behaviour weight
pi_prox / mu = w; the same example also rejects tokens with w > 5 (``rejection_sampling: {metric: ratio,
upper: 5.0}``, action ``mask`` by default): ``c_high`` here.

The statistic is over the **global** batch: the m2 of every rank are gathered (``all_gather``; the
rule needs the whole sorted multiset, no fixed-size sufficient statistic gives it), every rank
finds the same cut value v = the k-th largest m2, and masks its own tokens with m2 >= v. That is
AReaL's rule up to ties at the cut (AReaL's unstable sort masks an arbitrary subset of a tied group;
here the whole group goes, which keeps the rest's mean below tau and makes the result independent
of the order of the data and of how it is split across ranks). AReaL applies the rule to each
micro-batch on each rank. If the batch mean of m2 is already below tau nothing is gathered
(all ranks see the same all-reduced mean and skip together).
"""

from __future__ import annotations

import math

import torch

from ais_lightning import ops
from ais_lightning.correctors.ais import AISParams, ais_params
from ais_lightning.correctors.base import Corrector, RawCorrection
from ais_lightning.correctors.distributed import all_gather_values, all_reduce_sum


def m2po_cut(values: torch.Tensor, tau: float) -> torch.Tensor:
    """The cut value v of AReaL's rule on the 1-D ``values`` (m2 >= v is masked); +inf masks nothing.  # 0-dim

    ``s`` = values sorted descending, ``k`` = first index with ``mean(s[k:]) < tau`` (or ``n - 1`` if
    there is none); ``v = s[k - 1]`` for ``k > 0``, else +inf. Masking ``m2 >= v`` takes a whole tied
    group at the cut; in the degenerate no-suffix-below case a tie at the smallest value masks all.
    """
    n = values.numel()
    inf = torch.full((), math.inf, dtype=values.dtype, device=values.device)
    if n == 0:
        return inf
    s = torch.sort(values, descending=True).values  # [N]
    suffix_mean = s.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=s.dtype, device=s.device)  # [N]
    below = torch.nonzero(suffix_mean < tau)
    k = int(below[0, 0]) if below.numel() else n - 1
    return s[k - 1] if k > 0 else inf


class M2PO(Corrector):
    """Mask the tokens of largest delta^2 until the mean of the rest is < ``tau``; kept tokens weigh w.

    Args:
        tau: second-moment threshold tau_M2 > 0 (AReaL ``actor.m2_threshold``, 0.04 in its example).
        c_high: optional: tokens with w > c_high are also rejected (AReaL ``rejection_sampling`` with
            ``metric: ratio, upper: c_high``; 5.0 in its M2PO example). None = no bound.

    If ``torch.distributed`` is initialized every rank must call the corrector (all-reduce, and
    all-gather when the mean exceeds tau). Extra stats (global): ``m2po/m2_mean`` (mean delta^2 before
    masking), ``m2po/m2_mean_kept`` (after the M2PO mask, < tau), ``m2po/masked_frac`` (tokens masked by
    the second-moment rule alone; ``corrector/masked_frac`` also counts ``c_high`` rejections).
    """

    def __init__(self, tau: float = 0.04, c_high: float | None = None) -> None:
        super().__init__()
        ok = isinstance(tau, (int, float)) and not isinstance(tau, bool) and math.isfinite(tau)
        if not (ok and tau > 0):
            raise ValueError(f"tau must be a finite number > 0, got {tau!r}")
        number = isinstance(c_high, (int, float)) and not isinstance(c_high, bool)
        if c_high is not None and not (number and math.isfinite(c_high) and c_high >= 1.0):
            raise ValueError(f"c_high must be None or a finite number >= 1, got {c_high!r}")
        self.tau = float(tau)
        self.c_high = None if c_high is None else float(c_high)

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> RawCorrection:
        m2 = delta.double().square()  # [B, T]
        sums = all_reduce_sum(torch.stack([ops.masked_sum(m2, mask), mask.sum().double()]))  # [2]
        total, count = sums.unbind()
        mean = total / count.clamp(min=1.0)
        if bool(mean < self.tau):  # same decision on every rank: skip the gather
            cut = torch.full((), math.inf, dtype=m2.dtype)
        else:
            cut = m2po_cut(all_gather_values(m2[mask]), self.tau)
        masked = mask & (m2 >= cut)  # [B, T]
        kept_stats = all_reduce_sum(torch.stack([ops.masked_sum(m2, mask & ~masked), masked.sum().double()]))
        kept_total, n_masked = kept_stats.unbind()
        keep = mask & ~masked
        if self.c_high is not None:
            keep = keep & (torch.exp(delta) <= self.c_high)
        extra = {
            "m2po/m2_mean": mean,
            "m2po/m2_mean_kept": kept_total / (count - n_masked).clamp(min=1.0),
            "m2po/masked_frac": n_masked / count.clamp(min=1.0),
        }
        return RawCorrection(torch.exp(delta), keep, torch.zeros_like(mask), extra)

    def diagnostic_params(self) -> AISParams:
        """C = ``c_high`` when set, else AIS's default (:meth:`Corrector.diagnostic_params`)."""
        return ais_params() if self.c_high is None else ais_params(c=self.c_high, base="mis")

    def extra_repr(self) -> str:
        return f"tau={self.tau}, c_high={self.c_high}"
