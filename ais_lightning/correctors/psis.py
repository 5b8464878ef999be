"""Pareto-smoothed importance sampling (PSIS): the k-hat tail diagnostic and smoothed weights.

Vehtari, Simpson, Gelman, Yao & Gabry, "Pareto Smoothed Importance Sampling" (JMLR 2024,
arXiv 1507.02646): fit a generalized Pareto distribution (GPD) to the M largest importance weights,
M = ceil(min(0.2 S, 3 sqrt(S))) of S draws, as exceedances over the (M+1)-th largest weight u. The
fitted shape k-hat says how heavy the tail is: the IS estimate has finite variance for k < 1/2 and is
unreliable for k-hat > 0.7 (the paper's threshold; ``KHAT_UNRELIABLE``). Smoothing replaces the
tail weights, in order, by the GPD's expected order statistics u + F^-1((z - 1/2) / M), z = 1..M,
capped at the largest raw weight.

The fit is Zhang & Stephens (2009, Technometrics 51(3), "A new and efficient estimation method for
the generalized Pareto distribution") with the weakly informative prior of the PSIS paper: for
ascending exceedances x (n of them), m = 30 + floor(sqrt(n)) candidate values
theta_j = 1/x_n + (1 - sqrt(m / (j - 1/2))) / (3 x_q), x_q the first-quartile exceedance; profile
k(theta) = mean log(1 - theta x) and log-likelihood n (log(-theta / k) - k - 1); theta-hat = the
likelihood-weighted mean of the theta_j; k-hat = mean log(1 - theta-hat x), sigma = -k-hat / theta-hat,
then k-hat <- (n k-hat + 10 * 0.5) / (n + 10). (Same algorithm as ArviZ's ``_gpdfit`` and loo's
``gpdfit``; computed here in float64 torch.) Sign convention: k > 0 is a heavy (Pareto-like) tail;
weights with survival ~ w^-a have k = 1/a.
"""

from __future__ import annotations

import math

import torch

from ais_lightning import ops
from ais_lightning.checks import check_int
from ais_lightning.correctors.base import Corrector, RawCorrection, check_level
from ais_lightning.correctors.distributed import all_gather_values, all_reduce_sum

KHAT_UNRELIABLE = 0.7
"""k-hat above this: the importance-sampling estimate is unreliable (Vehtari et al. 2024)."""
MIN_TAIL = 5
"""Fewer tail draws than this and no fit is attempted (ArviZ / loo: "n_draws_tail must be at least 5")."""
PRIOR_K_WEIGHT = 10.0
"""Weight (in draws) of the prior k = 0.5 added to the fitted shape (PSIS paper, Appendix)."""


def psis_tail_length(num_draws: int) -> int:
    """M = ceil(min(0.2 S, 3 sqrt(S))) for S draws (Vehtari et al. 2024, Section 3)."""
    if num_draws <= 0:
        return 0
    return int(math.ceil(min(0.2 * num_draws, 3.0 * math.sqrt(num_draws))))


def gpd_fit(exceedances: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k-hat, sigma-hat) of a GPD fitted to ascending positive ``exceedances`` (Zhang & Stephens + prior).

    ``exceedances``: 1-D, sorted ascending, > 0, at least ``MIN_TAIL`` values (ValueError otherwise).
    Returns 0-dim float64 tensors. See the module docstring for the algorithm.
    """
    x = exceedances.double()
    n = x.numel()
    if x.dim() != 1 or n < MIN_TAIL:
        raise ValueError(
            f"exceedances must be 1-D with at least {MIN_TAIL} values, got shape {tuple(x.shape)}"
        )
    if not bool((x > 0).all()) or not bool((x[1:] >= x[:-1]).all()):
        raise ValueError("exceedances must be positive and sorted ascending")
    m = 30 + int(math.sqrt(n))
    j = torch.arange(1, m + 1, dtype=torch.float64, device=x.device)  # [m]
    quartile = x[int(n / 4 + 0.5) - 1]
    theta = 1.0 / x[-1] + (1.0 - torch.sqrt(m / (j - 0.5))) / (3.0 * quartile)  # [m]
    k = torch.log1p(-theta[:, None] * x[None, :]).mean(dim=1)  # [m]
    log_lik = n * (torch.log(-theta / k) - k - 1.0)  # [m] profile log-likelihood
    weights = torch.softmax(log_lik, dim=0)  # [m] = 1 / sum_j exp(l_j - l_i)
    weights = torch.where(weights >= 10 * torch.finfo(torch.float64).eps, weights, torch.zeros_like(weights))
    theta_hat = (theta * weights).sum() / weights.sum()
    k_hat = torch.log1p(-theta_hat * x).mean()
    sigma = -k_hat / theta_hat
    k_hat = (n * k_hat + PRIOR_K_WEIGHT * 0.5) / (n + PRIOR_K_WEIGHT)
    return k_hat, sigma


def gpd_quantile(p: torch.Tensor, k: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Inverse CDF of the GPD(k, sigma) at ``p``: sigma (( 1 - p)^-k - 1) / k (sigma (-log(1 - p)) at k = 0)."""
    p = p.double()
    if abs(float(k)) < 1e-12:
        return -sigma * torch.log1p(-p)
    return sigma * torch.expm1(-k * torch.log1p(-p)) / k


def pareto_khat(
    top_log_weights: torch.Tensor, num_draws: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """k-hat from the largest log-weights of S = ``num_draws`` draws; NaN when the tail is too short.

    Args:
        top_log_weights: 1-D, the largest log-weights in descending order (at least M + 1 of them
            when available; -inf padding is ignored). Only the top M + 1 are used.
        num_draws: S, the total number of draws the log-weights were taken from.

    Returns ``(k_hat, fit)``: k-hat (0-dim float64, NaN when fewer than ``MIN_TAIL`` draws exceed the
    cutoff, e.g. constant weights) and ``fit`` with ``k``, ``sigma``, ``cutoff`` (log u), ``max`` (log of
    the largest weight), ``tail`` (the ascending tail log-weights) for smoothing.
    """
    top = top_log_weights.double()
    top = top[torch.isfinite(top)]
    nan = torch.full((), math.nan, dtype=torch.float64, device=top.device)
    m = min(psis_tail_length(num_draws), top.numel() - 1)
    if m < MIN_TAIL:
        return nan, {}
    top = torch.sort(top, descending=True).values[: m + 1]
    log_max = top[0]
    # ArviZ floors the cutoff at the smallest positive double relative to the largest weight.
    cutoff = torch.maximum(top[m], log_max + math.log(torch.finfo(torch.float64).tiny))
    tail = torch.flip(top[:m][top[:m] > cutoff], dims=[0])  # ascending
    if tail.numel() < MIN_TAIL:
        return nan, {}
    exceedances = torch.exp(tail - log_max) - torch.exp(cutoff - log_max)  # > 0, ascending
    k_hat, sigma = gpd_fit(exceedances)
    if not bool(torch.isfinite(k_hat)):
        return nan, {}
    return k_hat, {"k": k_hat, "sigma": sigma, "cutoff": cutoff, "max": log_max, "tail": tail}


def smooth_log_weights(log_weights: torch.Tensor, fit: dict[str, torch.Tensor]) -> torch.Tensor:
    """``log_weights`` with every value in the fitted tail replaced by its smoothed value.  # same shape

    A value v > cutoff at ascending position z (0-based, among the ``fit["tail"]`` values; ties share
    the lowest position) becomes log(u + F^-1((z + 1/2) / M)), capped at the largest raw weight.
    ``fit`` comes from ``pareto_khat`` (empty: returned unchanged).
    """
    if not fit:
        return log_weights
    lw = log_weights.double()
    tail = fit["tail"]  # ascending, relative positions come from the global tail
    n_tail = tail.numel()
    log_max, cutoff = fit["max"], fit["cutoff"]
    p = (torch.arange(n_tail, dtype=torch.float64, device=lw.device) + 0.5) / n_tail  # [M]
    smoothed_rel = torch.exp(cutoff - log_max) + gpd_quantile(p, fit["k"], fit["sigma"])  # [M], weight / max
    smoothed = torch.log(smoothed_rel.clamp(max=1.0)) + log_max  # [M], capped at the largest raw weight
    in_tail = lw > cutoff
    position = torch.searchsorted(tail, lw.clamp(max=tail[-1]).contiguous(), right=False).clamp(
        max=n_tail - 1
    )
    return torch.where(in_tail, smoothed[position], lw).to(log_weights.dtype)


class PSIS(Corrector):
    """Pareto-smoothed IS weights of the global batch (no truncation); ``psis/khat`` says if they are reliable.

    The draws are the valid tokens (``level="token"``) or the responses with a valid token
    (``"sequence"``: product of the token ratios; ``"geometric"``: geometric mean), with the level
    log-ratios clamped to +-20 as in ``TIS``. The largest ``max_tail + 1`` log-weights of every rank are
    gathered, so every rank fits the same GPD to the tail of the concatenated batch and smooths its
    own tail draws (exact: the global top-M is within the union of the per-rank top-M). With fewer
    than 5 tail draws (tiny batches, constant weights) the raw ratios are kept. Nothing is masked.

    Args:
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        max_tail: cap (>= 5) on M; M = ceil(min(0.2 S, 3 sqrt(S))) reaches 4096 at S ~ 1.9M draws.

    Extra stats: ``psis/khat`` (0 when no fit), ``psis/fitted`` (1 if the tail was smoothed),
    ``psis/tail_frac`` (draws in the smoothed tail / S).
    """

    def __init__(self, level: str = "token", max_tail: int = 4096) -> None:
        super().__init__()
        check_level(level)
        check_int(max_tail, "max_tail", MIN_TAIL)
        self.level = level
        self.max_tail = int(max_tail)

    def correct(
        self,
        delta: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor | None,
        entropy: torch.Tensor | None,
    ) -> RawCorrection:
        if self.level == "token":
            log_w, draws = delta.double(), mask  # [B, T]
        else:
            log_w = ops.sequence_log_ratio(delta, mask, self.level).double()  # [B, T], constant per row
            log_w = log_w[:, :1] if log_w.shape[-1] else log_w.new_zeros(log_w.shape[0], 1)  # [B, 1]
            draws = mask.any(dim=-1, keepdim=True)  # [B, 1]
        values = log_w[draws]  # [S_local]
        k = min(self.max_tail + 1, values.numel())
        local_top = torch.full((self.max_tail + 1,), -math.inf, dtype=torch.float64, device=delta.device)
        local_top[:k] = torch.topk(values, k).values if k else local_top[:0]
        num_draws = int(all_reduce_sum(torch.stack([draws.sum().double()]))[0])
        gathered = all_gather_values(local_top)  # [R (max_tail + 1)]
        global_top = torch.topk(gathered, self.max_tail + 1).values  # the same M cap in every process
        k_hat, fit = pareto_khat(global_top, num_draws)
        smoothed = smooth_log_weights(log_w, fit)  # [B, T] or [B, 1]
        weights = torch.exp(smoothed).expand_as(delta).float()  # [B, T]
        in_tail = draws & (log_w > fit["cutoff"]) if fit else torch.zeros_like(draws)
        n_tail = all_reduce_sum(torch.stack([in_tail.sum().double()]))[0]
        extra = {
            "psis/khat": torch.nan_to_num(k_hat, nan=0.0),
            "psis/fitted": torch.tensor(1.0 if fit else 0.0, dtype=torch.float64),
            "psis/tail_frac": n_tail / max(num_draws, 1),
        }
        return RawCorrection(weights, mask, torch.zeros_like(mask), extra)

    def extra_repr(self) -> str:
        return f"level={self.level!r}, max_tail={self.max_tail}"
