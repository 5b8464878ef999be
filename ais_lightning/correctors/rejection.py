"""Divergence rejection ("trust region masking"): verl's ``rollout_rs`` options, combinable with token TIS.

Follows ``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_rollout_rejection_mask``,
``compute_rollout_correction_weights``) and verl's documentation ``docs/algo/rollout_corr.md``. With
delta = log pi_old - log mu (our ``delta``, clamped to +-20 like verl's ``SAFETY_BOUND``) verl's
per-token statistics are

- k1 = -delta = log mu - log pi                  (can be negative)
- k2 = delta^2 / 2                               (>= 0, symmetric in delta)
- k3 = exp(delta) - 1 - delta = w - 1 - log w    (>= 0, grows exponentially for w > 1, linearly for w < 1)

and each option rejects at the token level (``token_k*``) or rejects whole responses on the sum
(``seq_sum_k*``), the mean over valid tokens (``seq_mean_k*``) or the maximum (``seq_max_k2``,
``seq_max_k3``; verl has no ``seq_max_k1``) of the token statistic:

- ``*_k2`` / ``*_k3``: one-sided, keep iff statistic <= threshold.
- ``*_k1``: two-sided bounds on exp(statistic), i.e. on the ratio mu / pi at that level (the token
  ratio, the product over the response, or its geometric mean): keep iff
  ``lower <= exp(statistic) <= upper``, equivalently ``1/upper <= w_level <= 1/lower`` for our
  w = pi / mu. verl takes the bounds as a ``"lower_upper"`` string; a single number t means
  lower = 1/t, i.e. the symmetric rejection |log w_level| > log t. Here the upper bound is the option
  (``token_k1=2.0``) and the lower bound ``<option>_lower`` (default 1/upper), with verl's meaning, so
  verl's numbers carry over unchanged.

Several options may be set at once, each with its own threshold; a token stays only if every option
keeps it (verl: "All requested options must pass"). Rejected tokens and responses leave the loss
and its denominator (verl sets ``response_mask`` to 0). The weight of a kept token is 1, or, with
``tis_level`` set, verl's truncated IS weight ``min(w_level, tis_c_high)`` (``rollout_is`` +
``rollout_is_threshold``; the ``*_rs_token_tis`` / ``*_rs_seq_tis`` presets), optionally normalised
to mean 1 over the batch (``rollout_is_batch_normalize``; like verl, over the valid tokens *before*
rejection, see ``ais_lightning.correctors.batch_norm``).

Differences from verl: the sequence sums are of the per-token clamped log-ratios and are not clamped
again (as in verl); a sequence with no valid token never counts in the sequence fractions (verl's
``rollout_rs_seq_masked_fraction`` divides by all B rows).
"""

from __future__ import annotations

import math

import torch

from ais_lightning import ops
from ais_lightning.correctors.ais import AISParams, ais_params
from ais_lightning.correctors.base import LEVELS, Corrector, RawCorrection, level_ratio
from ais_lightning.correctors.batch_norm import batch_normalize

RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""verl's ``rollout_rs`` option names (``SUPPORTED_ROLLOUT_RS_OPTIONS``), also our argument names."""

K1_OPTIONS = ("token_k1", "seq_sum_k1", "seq_mean_k1")
"""The two-sided ratio options; each has a ``<option>_lower`` argument."""


def token_divergences(delta: torch.Tensor) -> dict[str, torch.Tensor]:
    """verl's per-token statistics k1 = -delta, k2 = delta^2 / 2, k3 = e^delta - 1 - delta.  # [B, T] float64

    k3 uses ``expm1`` in float64, exact for the tiny log-ratios of FP8 rollouts.
    """
    d = delta.double()
    return {"k1": -d, "k2": 0.5 * d.square(), "k3": torch.expm1(d) - d}


def masked_max(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Max of ``x`` over valid entries (all, or along ``dim``); 0 where there are none (as verl)."""
    if dim is None:
        if x.numel() == 0:
            return x.new_zeros(())
        value = torch.where(mask, x, torch.full_like(x, -math.inf)).amax()
        return torch.where(mask.any(), value, torch.zeros_like(value))
    if x.shape[dim] == 0:
        return x.new_zeros(x.sum(dim=dim).shape)
    value = torch.where(mask, x, torch.full_like(x, -math.inf)).amax(dim=dim)
    return torch.where(mask.any(dim=dim), value, torch.zeros_like(value))


def rejection_statistic(delta: torch.Tensor, mask: torch.Tensor, option: str) -> torch.Tensor:
    """verl's statistic of ``option`` per token, or per response broadcast to its tokens.  # [B, T] float64"""
    if option not in RS_OPTIONS:
        raise ValueError(f"option must be one of {RS_OPTIONS}, got {option!r}")
    level, _, kind = option.rpartition("_")  # "token" / "seq_sum" / "seq_mean" / "seq_max", "k1".."k3"
    token = token_divergences(delta)[kind]  # [B, T]
    if level == "token":
        return token
    if level == "seq_sum":
        seq = ops.masked_sum(token, mask, dim=-1)  # [B]
    elif level == "seq_mean":
        seq = ops.masked_mean(token, mask, dim=-1)  # [B]
    else:
        seq = masked_max(token, mask, dim=-1)  # [B]
    return seq.unsqueeze(-1).expand_as(token)


def rejection_keep(
    statistic: torch.Tensor, option: str, upper: float, lower: float | None = None
) -> torch.Tensor:
    """Tokens kept by ``option``: k1 ``log(lower) <= s <= log(upper)``, k2/k3 ``s <= upper``.  # [B, T] bool

    For a k1 option ``lower`` defaults to ``1 / upper`` (verl's single-number threshold).
    """
    if option in K1_OPTIONS:
        lo = 1.0 / upper if lower is None else lower
        return (statistic >= math.log(lo)) & (statistic <= math.log(upper))
    return statistic <= upper


def _check_threshold(name: str, value: float | None, low: float, high: float, low_open: bool) -> None:
    """ValueError naming ``name`` unless ``value`` is None or a finite number in (low, high] / [low, high]."""
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{']' if math.isfinite(high) else ')'}"
        raise ValueError(f"{name} must be None or a finite number in {interval}, got {value!r}")


class DivergenceRejection(Corrector):
    """Reject tokens / responses whose divergence statistic exceeds its threshold (verl ``rollout_rs``).

    Every ``rollout_rs`` option of verl is an argument named like the option, None (off) or its
    threshold; set several to combine them (see the module docstring for the exact definitions).
    Rejected tokens leave the loss and its denominator; kept tokens weigh 1, or min(w_level,
    tis_c_high) with ``tis_level`` set.

    Args:
        token_k1, seq_sum_k1, seq_mean_k1: upper bound (>= 1) on mu/pi at that level (verl's
            ``rollout_rs_threshold``); the lower bound is ``<option>_lower`` (in (0, 1], default 1/upper).
        token_k2, token_k3, seq_sum_k2, seq_sum_k3, seq_mean_k2, seq_mean_k3, seq_max_k2, seq_max_k3:
            upper bound (> 0) on the divergence statistic.
        token_k1_lower, seq_sum_k1_lower, seq_mean_k1_lower: verl's lower ratio bound (the part
            before ``_`` of ``"lower_upper"``); only with the matching upper bound set.
        tis_level: None (kept tokens weigh 1) or the level of the truncated IS weight: ``"token"``,
            ``"sequence"`` or ``"geometric"`` (verl ``rollout_is``).
        tis_c_high: truncation C >= 1 of that weight (verl ``rollout_is_threshold``).
        tis_batch_normalize: divide the truncated weights by their mean over the global batch (verl
            ``rollout_is_batch_normalize``); needs ``tis_level``. All-reduced when distributed.

    Extra stats, per option ``o``: ``rs/o/masked_frac`` (tokens rejected by o; verl
    ``rollout_rs_o_masked_fraction``), ``rs/o/seq_masked_frac`` (responses with a token rejected by o),
    ``rs/o/mean`` (token mean of the statistic; verl ``rollout_rs_o_mean``), ``rs/o/max``; overall
    ``rs/masked_frac`` (verl ``rollout_rs_masked_fraction``), ``rs/seq_masked_frac``
    (``rollout_rs_seq_masked_fraction``); with batch normalisation ``tis/batch_norm_factor``.
    """

    def __init__(
        self,
        token_k1: float | None = None,
        token_k2: float | None = None,
        token_k3: float | None = None,
        seq_sum_k1: float | None = None,
        seq_sum_k2: float | None = None,
        seq_sum_k3: float | None = None,
        seq_mean_k1: float | None = None,
        seq_mean_k2: float | None = None,
        seq_mean_k3: float | None = None,
        seq_max_k2: float | None = None,
        seq_max_k3: float | None = None,
        token_k1_lower: float | None = None,
        seq_sum_k1_lower: float | None = None,
        seq_mean_k1_lower: float | None = None,
        tis_level: str | None = None,
        tis_c_high: float = 2.0,
        tis_batch_normalize: bool = False,
    ) -> None:
        super().__init__()
        uppers = {
            "token_k1": token_k1,
            "token_k2": token_k2,
            "token_k3": token_k3,
            "seq_sum_k1": seq_sum_k1,
            "seq_sum_k2": seq_sum_k2,
            "seq_sum_k3": seq_sum_k3,
            "seq_mean_k1": seq_mean_k1,
            "seq_mean_k2": seq_mean_k2,
            "seq_mean_k3": seq_mean_k3,
            "seq_max_k2": seq_max_k2,
            "seq_max_k3": seq_max_k3,
        }
        lowers = {
            "token_k1": token_k1_lower,
            "seq_sum_k1": seq_sum_k1_lower,
            "seq_mean_k1": seq_mean_k1_lower,
        }
        for option, upper in uppers.items():
            k1 = option in K1_OPTIONS  # a ratio bound >= 1, else a divergence bound > 0
            _check_threshold(option, upper, 1.0 if k1 else 0.0, math.inf, low_open=not k1)
        for option, lower in lowers.items():
            _check_threshold(f"{option}_lower", lower, 0.0, 1.0, low_open=True)
            if lower is not None and uppers[option] is None:
                raise ValueError(
                    f"{option}_lower is set ({lower}) but {option} is None: set the upper bound too"
                )
        if tis_level is not None and tis_level not in LEVELS:
            raise ValueError(f"tis_level must be None or one of {LEVELS}, got {tis_level!r}")
        ok = isinstance(tis_c_high, (int, float)) and not isinstance(tis_c_high, bool)
        if not (ok and math.isfinite(tis_c_high) and tis_c_high >= 1.0):
            raise ValueError(f"tis_c_high must be a finite number >= 1, got {tis_c_high!r}")
        if tis_batch_normalize and tis_level is None:
            raise ValueError("tis_batch_normalize needs tis_level (the IS weights it normalises)")
        self.criteria: dict[str, tuple[float, float | None]] = {
            option: (float(upper), None if lowers.get(option) is None else float(lowers[option]))
            for option, upper in uppers.items()
            if upper is not None
        }
        self.tis_level = tis_level
        self.tis_c_high = float(tis_c_high)
        self.tis_batch_normalize = bool(tis_batch_normalize)

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> RawCorrection:
        n_tokens = mask.sum().clamp(min=1).double()
        n_seqs = mask.any(dim=-1).sum().clamp(min=1).double()
        keep = mask.clone()  # [B, T]
        extra: dict[str, torch.Tensor] = {}
        for option, (upper, lower) in self.criteria.items():
            statistic = rejection_statistic(delta, mask, option)  # [B, T] float64
            rejected = mask & ~rejection_keep(statistic, option, upper, lower)  # [B, T]
            keep = keep & ~rejected
            extra[f"rs/{option}/masked_frac"] = rejected.sum().double() / n_tokens
            extra[f"rs/{option}/seq_masked_frac"] = rejected.any(dim=-1).sum().double() / n_seqs
            extra[f"rs/{option}/mean"] = ops.masked_mean(statistic, mask)
            extra[f"rs/{option}/max"] = masked_max(statistic, mask)
        rejected = mask & ~keep
        extra["rs/masked_frac"] = rejected.sum().double() / n_tokens
        extra["rs/seq_masked_frac"] = rejected.any(dim=-1).sum().double() / n_seqs
        if self.tis_level is None:
            return RawCorrection(mask.to(delta.dtype), keep, torch.zeros_like(mask), extra)
        ratio = level_ratio(delta, mask, self.tis_level)  # [B, T]
        weights = ratio.clamp(max=self.tis_c_high)  # [B, T]
        if self.tis_batch_normalize:
            weights, extra["tis/batch_norm_factor"] = batch_normalize(weights, mask, self.tis_level)
        return RawCorrection(weights, keep, keep & (ratio > self.tis_c_high), extra)  # clipped among kept

    def diagnostic_params(self) -> AISParams:
        """C = ``tis_c_high`` with ``tis_level`` set, else AIS's default (:meth:`Corrector.diagnostic_params`)."""
        return ais_params() if self.tis_level is None else ais_params(c=self.tis_c_high)

    def extra_repr(self) -> str:
        criteria = ", ".join(
            f"{o}={u}" + ("" if lo is None else f", {o}_lower={lo}") for o, (u, lo) in self.criteria.items()
        )
        return (
            f"{criteria or 'no rejection'}, tis_level={self.tis_level!r}, tis_c_high={self.tis_c_high}, "
            f"tis_batch_normalize={self.tis_batch_normalize}"
        )
