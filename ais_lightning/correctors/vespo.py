"""VESPO: a smooth Gamma-shaped weight phi(W) = W^k exp(lambda (1 - W)) of the sequence ratio W.

VESPO (arXiv 2602.10693) as TRL implements it (``loss_type="vespo"``, ``trl/trainer/grpo_trainer.py``,
``GRPOTrainer.get_gamma_weights``; defaults in ``trl/trainer/grpo_config.py``):

- W is the **product** over the response (a sum of log-ratios, "not a mean"), not a geometric mean:
  log W = sum_t log(pi_theta / pi_old) + sum_t log(rho_t), where rho_t is TRL's token IS ratio
  pi_old / mu after its ``vllm_importance_sampling_mode`` correction (VESPO requires ``token_truncate``
  (default: rho_t = min(pi_old/mu, C_max = 3)) or ``token_mask`` (rho_t = 0 outside [C_min, C_max])).
  Each log(rho_t) and log W are clamped to [log 1e-8, 20].
- phi = exp(lambda + k log W - lambda W), detached, (k, lambda) = (k_pos, lambda_pos) = (2, 3) where
  A >= 0 and (k_neg, lambda_neg) = (3, 2) where A < 0, with lambda floored at 1e-4; phi(1) = 1.

Here pi_theta = pi_old (the weight is computed before the update), so log W = sum_t log rho_t: the
sequence ratio of pi_old / mu with each token ratio truncated (or masked) first. TRL uses phi in a
REINFORCE loss -phi A log pi_theta and re-evaluates W with the current pi_theta at every micro-step;
as a corrector, phi multiplies GRPO's clipped surrogate (same gradient at pi_theta = pi_old). phi
peaks at W = k / lambda (2/3 for A >= 0, 3/2 for A < 0) and decays exponentially for large W, so
runaway sequence ratios are suppressed smoothly rather than clipped.
"""

from __future__ import annotations

import math

import torch

from ais_lightning import ops
from ais_lightning.correctors.advantage import token_advantages
from ais_lightning.correctors.ais import AISParams, ais_params
from ais_lightning.correctors.base import Corrector, RawCorrection

LOG_W_MIN = math.log(1e-8)
"""TRL's lower clamp of each log rho_t and of log W (``lower_clamp = math.log(1e-8)``)."""
LOG_W_MAX = 20.0
"""TRL's upper clamp of log W."""
LAMBDA_FLOOR = 1e-4
"""TRL floors lambda at this value (``lambda_seq.clamp(min=1e-4)``)."""


def vespo_phi(log_w: torch.Tensor, k: torch.Tensor | float, lam: torch.Tensor | float) -> torch.Tensor:
    """phi(W) = exp(lambda + k log W - lambda W) from log W (clamped to [log 1e-8, 20]); NaN/inf -> 0."""
    log_w = log_w.clamp(LOG_W_MIN, LOG_W_MAX)
    lam = torch.as_tensor(lam, dtype=log_w.dtype).clamp(min=LAMBDA_FLOOR)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _check_nonneg(name: str, value: float, strict: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and (value > 0 if strict else value >= 0)):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} 0, got {value!r}")
    return float(value)


class VESPO(Corrector):
    """weight = phi(W) per response, (k, lambda) by the sign of the advantage (TRL ``loss_type="vespo"``).

    Args:
        k_pos, lambda_pos: power exponent and decay of phi where A >= 0 (TRL ``vespo_k_pos`` = 2,
            ``vespo_lambda_pos`` = 3; c1, c2 of the paper's Section 3.4).
        k_neg, lambda_neg: the same where A < 0 (TRL ``vespo_k_neg`` = 3, ``vespo_lambda_neg`` = 2).
        token_c_high: C_max of the token ratio before the product (TRL
            ``vllm_importance_sampling_clip_max`` = 3.0); None = no upper bound.
        token_c_low: C_min (TRL ``vllm_importance_sampling_clip_min``, default None).
        token_mask: False = TRL ``token_truncate`` (clamp the token ratio to [C_min, C_max]); True =
            ``token_mask`` (a token ratio outside the band becomes 0, i.e. log rho = log 1e-8).

    Needs ``advantages``; with ``[B, T]`` advantages the sign is read per token (as TRL). No token
    leaves the mask. Extra stats: ``vespo/log_w_mean`` (mean over responses of log W),
    ``vespo/phi_mean`` (mean over responses of phi; by the sign of the first valid token's advantage
    when advantages are per token), ``vespo/token_clipped_frac`` (token ratios changed by the band).
    """

    def __init__(
        self,
        k_pos: float = 2.0,
        lambda_pos: float = 3.0,
        k_neg: float = 3.0,
        lambda_neg: float = 2.0,
        token_c_high: float | None = 3.0,
        token_c_low: float | None = None,
        token_mask: bool = False,
    ) -> None:
        super().__init__()
        self.k_pos = _check_nonneg("k_pos", k_pos, strict=False)
        self.lambda_pos = _check_nonneg("lambda_pos", lambda_pos, strict=True)
        self.k_neg = _check_nonneg("k_neg", k_neg, strict=False)
        self.lambda_neg = _check_nonneg("lambda_neg", lambda_neg, strict=True)
        if token_c_high is not None and not (math.isfinite(token_c_high) and token_c_high >= 1.0):
            raise ValueError(f"token_c_high must be None or a finite number >= 1, got {token_c_high!r}")
        if token_c_low is not None and not 0.0 <= token_c_low <= 1.0:
            raise ValueError(f"token_c_low must be None or in [0, 1], got {token_c_low!r}")
        self.token_c_high = None if token_c_high is None else float(token_c_high)
        self.token_c_low = None if token_c_low is None else float(token_c_low)
        self.token_mask = bool(token_mask)

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> RawCorrection:
        adv = token_advantages(advantages, mask, "VESPO")  # [B, T]
        d = delta.double()  # [B, T], log(pi_old / mu)
        lo = -math.inf if self.token_c_low is None else math.log(max(self.token_c_low, 1e-300))
        hi = math.inf if self.token_c_high is None else math.log(self.token_c_high)
        outside = mask & ((d < lo) | (d > hi))  # [B, T]
        if self.token_mask:
            log_rho = torch.where(outside, torch.full_like(d, LOG_W_MIN), d)  # log 0 -> log 1e-8
        else:
            log_rho = d.clamp(min=lo, max=hi)
        log_rho = log_rho.clamp(LOG_W_MIN, LOG_W_MAX)  # [B, T]
        log_w = ops.masked_sum(log_rho, mask, dim=-1).clamp(LOG_W_MIN, LOG_W_MAX)  # [B]
        log_w_tok = log_w.unsqueeze(-1).expand_as(d)  # [B, T]
        nonneg = adv >= 0  # [B, T]
        k = torch.where(nonneg, self.k_pos, self.k_neg).double()  # [B, T]
        lam = torch.where(nonneg, self.lambda_pos, self.lambda_neg).double()  # [B, T]
        phi = vespo_phi(log_w_tok, k, lam)  # [B, T]
        has_tokens = mask.any(dim=-1)  # [B]
        n_seqs = has_tokens.sum().clamp(min=1).double()
        first = mask.double().argmax(dim=-1, keepdim=True) if mask.shape[-1] else None
        phi_seq = phi.gather(-1, first).squeeze(-1) if first is not None else phi.new_zeros(mask.shape[0])
        extra = {
            "vespo/log_w_mean": ops.masked_sum(log_w, has_tokens) / n_seqs,
            "vespo/phi_mean": ops.masked_sum(phi_seq, has_tokens) / n_seqs,
            "vespo/token_clipped_frac": outside.sum().double() / mask.sum().clamp(min=1).double(),
        }
        return RawCorrection(phi.float(), mask, torch.zeros_like(mask), extra)

    def diagnostic_params(self) -> AISParams:
        """C = ``token_c_high`` (else AIS's default), the lower bound ``token_c_low``
        (:meth:`Corrector.diagnostic_params`)."""
        c = {} if self.token_c_high is None else {"c": self.token_c_high}
        return ais_params(**c, c_low=self.token_c_low)

    def extra_repr(self) -> str:
        return (
            f"k_pos={self.k_pos}, lambda_pos={self.lambda_pos}, k_neg={self.k_neg}, "
            f"lambda_neg={self.lambda_neg}, token_c_high={self.token_c_high}, "
            f"token_c_low={self.token_c_low}, token_mask={self.token_mask}"
        )
