"""Train/inference alignment metrics the peers log: NeMo-RL, verl's debug metrics, prime-rl's mismatch KL.

Every metric here shares ``update(train_logprobs, rollout_logprobs, mask, log_ratio=None)`` with ``[B, T]``
log-probs of the tokens the rollout policy mu sampled (``train_logprobs`` = log pi_old from the trainer,
``rollout_logprobs`` = log mu from the engine) and a ``[B, T]`` bool mask. delta = clamp(log pi - log mu,
+-20) and w = e^delta (``ais_lightning.ops.log_ratio``). Only the probabilities of the *sampled* token are
known, never the two full distributions, so every "divergence" below is a per-token function averaged over
the sampled tokens: an estimator (unbiased where said) or just a discrepancy score. Each docstring says which.

The per-token math is in pure functions (``mult_prob_error``, ``reverse_kl_terms``, ``js_terms``,
``sequence_mult_prob_error``); the Metric classes only accumulate. States are sums (extremes: max / min),
so a DDP/FSDP sync is exact (NeMo-RL normalises by the global token count as well; verl and prime-rl
gather the tokens). Before any valid item each metric returns a documented finite value, never NaN.

Peers' definitions (read in their sources, 2026 snapshots):

- NeMo-RL ``nemo_rl/algorithms/loss/loss_functions.py`` (``ClippedPGLossFn.__call__``) and
  ``docs/guides/grpo.md`` ("Metrics"): ``token_mult_prob_error`` = mean exp(|log mu - log pi_old|);
  ``gen_kl_error`` = mean k3 with log-ratio log pi_old - log mu, i.e. mean(w - 1 - delta) (NeMo's default
  ``reference_policy_kl_type="k3"``): that is ``MismatchKL("k3")`` exactly, no new metric;
  ``policy_kl_error`` = mean(1/w - 1 + delta) (k3 with the roles swapped); ``js_divergence_error`` =
  mean of 0.5 k3(pi_old : m) + 0.5 k3(mu : m) with m = (pi_old + mu) / 2 of the sampled token;
  ``nemo_rl/algorithms/grpo.py`` (``compute_and_apply_seq_logprob_error_masking``): the same
  exp|log mu - log pi_old| averaged per response, ``max/mean/min_seq_mult_prob_error``.
- verl ``verl/utils/debug/metrics.py`` (``calculate_debug_metrics``): ``training/rollout_probs_diff_{max,
  mean,std}`` of |exp(log pi_old) - exp(log mu)| over valid tokens (``torch.std``: Bessel), and
  ``training/rollout_actor_probs_pearson_corr``, ``torch.corrcoef`` of the two *probabilities* (its
  docstring says log-probs; the code exponentiates first). verl's file has no reverse KL or JS: those are
  NeMo-RL's ``policy_kl_error`` / ``js_divergence_error``.
- prime-rl ``src/prime_rl/trainer/rl/loss.py`` (``compute_importance_ratio_and_mismatch_kl``): per-token
  ``mismatch_kl`` = w - delta - 1 (our k3) with the trainer's *current* log-probs; ``train.py`` logs
  ``mismatch_kl/{all,<env>}/{mean,std,max}`` over the tokens (``torch.std``: Bessel), per environment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torchmetrics import Metric

from ais_lightning.correctors.ais import k3_per_token
from ais_lightning.diagnostics.base import (
    STATE_DTYPE,
    LogRatioMeanMetric,
    checked_log_ratio,
    sequence_mask,
)
from ais_lightning.ops import check_logprob_inputs, log_ratio, masked_mean, masked_sum

REVERSE_KL_ESTIMATORS = ("is_k3", "swapped_k3")
JS_ESTIMATORS = ("is", "log_cosh")
SEQUENCE_STATS = ("mean", "max", "min")
PROBABILITY_DIFF_STATS = ("mean", "max", "std")
KL_STATS = ("mean", "std", "max")
LN2 = math.log(2.0)
CONSTANT_TOL = 1e-10
"""``ProbabilityCorrelation``: a side whose n * variance is below this fraction of its sum of squares (a
relative spread std / rms under 1e-5) counts as constant, where the correlation is undefined."""


# ----------------------------------------------------------------------------------- pure per-token math
def mult_prob_error(delta: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's multiplicative probability error of each token: exp(|delta|) >= 1.  # same shape as delta

    ``exp(|log pi - log mu|)`` = max(pi, mu) / min(pi, mu) of the sampled token; 1 where they agree.
    """
    return torch.exp(delta.abs())


def reverse_kl_terms(delta: torch.Tensor, estimator: str = "is_k3") -> torch.Tensor:
    """Per-token terms whose mean over tokens sampled by mu relates to KL(pi || mu).  # same shape as delta

    ``is_k3``: 1 - w + w delta. On tokens sampled by pi, k3 = r - 1 - ln r with r = mu / pi = 1/w estimates
    KL(pi || mu); weighted by w = pi / mu it does so on tokens sampled by mu: E_mu[w (1/w - 1 + delta)] =
    1 - E_mu[w] + E_pi[delta] = KL(pi || mu) when E_mu[w] = 1 (mu covers pi's support). Unbiased, >= 0 per
    token (x ln x >= x - 1), heavy-tailed where pi >> mu.
    ``swapped_k3``: 1/w - 1 + delta, NeMo-RL's ``policy_kl_error`` (k3 with pi and mu swapped, on mu's
    samples). NOT an estimator of KL(pi || mu): its mean under mu is chi2(mu || pi) - KL(mu || pi)
    (E_mu[mu/pi] - 1 = chi2(mu || pi)); >= 0 per token and explodes where pi << mu (NeMo's docs: a token at
    log pi = -15, log mu = -5 scores e^10 - 11 = 22015). Both are delta^2 / 2 + O(delta^3) near 0.
    """
    if estimator == "is_k3":
        w = torch.exp(delta)
        return (1.0 - w + w * delta).clamp(min=0.0)  # clamp: rounding only
    if estimator == "swapped_k3":
        return (torch.expm1(-delta) + delta).clamp(min=0.0)
    raise ValueError(f"estimator must be one of {REVERSE_KL_ESTIMATORS}, got {estimator!r}")


def js_terms(delta: torch.Tensor, estimator: str = "is") -> torch.Tensor:
    """Per-token Jensen-Shannon terms of pi and mu from tokens sampled by mu.  # same shape as delta

    ``is``: 0.5 w ln(2w / (1 + w)) + 0.5 ln(2 / (1 + w)), an unbiased estimator of
    JS(pi, mu) = 0.5 KL(pi || m) + 0.5 KL(mu || m), m = (pi + mu) / 2: the second KL is E_mu[ln(mu / m)] and
    the first E_pi[ln(pi / m)] = E_mu[w ln(pi / m)], with pi / m = 2w / (1 + w) and mu / m = 2 / (1 + w).
    Convex in w with its minimum 0 at w = 1, so >= 0 per token; its mean is <= ln 2 in expectation.
    ``log_cosh``: ln cosh(delta / 2), exactly NeMo-RL's ``js_divergence_error`` term 0.5 k3(pi : m) +
    0.5 k3(mu : m) on the sampled token's probabilities (with a = ln(pi/m), b = ln(mu/m): e^a + e^b = 2, so
    the term is -(a + b) / 2 = ln((pi + mu) / 2) - ln sqrt(pi mu) = ln cosh(delta / 2)). A symmetric score,
    not an estimator of JS. NeMo's docs put the -15 / -5 example at "~9"; its code gives ln cosh(5) = 4.307.
    Both are delta^2 / 8 + O(delta^3) near 0.
    """
    if estimator == "is":
        w = torch.exp(delta)
        # ln(2w / (1 + w)) = ln 2 - softplus(-delta);  ln(2 / (1 + w)) = ln 2 - softplus(delta)
        terms = 0.5 * w * (LN2 - F.softplus(-delta)) + 0.5 * (LN2 - F.softplus(delta))
        return terms.clamp(min=0.0)  # clamp: rounding only
    if estimator == "log_cosh":
        a = delta.abs()
        return (0.5 * a + torch.log1p(torch.exp(-a)) - LN2).clamp(min=0.0)  # ln cosh(a/2), overflow-free
    raise ValueError(f"estimator must be one of {JS_ESTIMATORS}, got {estimator!r}")


def sequence_mult_prob_error(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Each response's mean exp(|log pi - log mu|) over its valid tokens (NeMo-RL ``seq_mult_prob_error``).

    Returns ``[B]`` (float64). NeMo-RL ``compute_and_apply_seq_logprob_error_masking`` (``nemo_rl/algorithms/grpo.py``): "the same
    calculation as token_mult_prob_error but per-sequence"; its ``seq_logprob_error_threshold`` drops the
    responses above the threshold. A response without valid tokens gets 1.0 (no evidence of mismatch).
    Validates the shared signature; delta is clamped to +-20 as everywhere here.
    """
    check_logprob_inputs(train_logprobs, rollout_logprobs, mask)
    delta = log_ratio(train_logprobs, rollout_logprobs, mask).to(STATE_DTYPE)  # [B, T]
    per_row = masked_mean(mult_prob_error(delta), mask, dim=-1)  # [B]
    return torch.where(sequence_mask(mask), per_row, torch.ones_like(per_row))  # [B]


def responses_within_error(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, threshold: float | None
) -> torch.Tensor | None:
    """The responses whose :func:`sequence_mult_prob_error` (the mean exp|log pi - log mu| over their tokens) is at most
    ``threshold`` (``[B]`` bool; NeMo-RL's ``seq_logprob_error_threshold``); None when ``threshold`` is None."""
    if threshold is None:
        return None
    return sequence_mult_prob_error(train_logprobs, rollout_logprobs, mask) <= threshold  # [B]


def _probabilities(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(log p) on valid tokens, 0 on masked ones (padding may hold -inf or NaN).  # [B, T] float64"""
    lp = logprobs.detach().to(STATE_DTYPE)
    return torch.where(mask, torch.exp(torch.where(mask, lp, torch.zeros_like(lp))), torch.zeros_like(lp))


# ------------------------------------------------------------------------------------------- metrics
class TokenMultProbError(LogRatioMeanMetric):
    """NeMo-RL's ``token_mult_prob_error``: mean over valid tokens of exp(|log pi_old - log mu|) >= 1.

    NeMo-RL's threshold for a new model is 1.05 "for equal precision" (``docs/adding-new-models.md``: 1.0 is a
    perfect match, above 1.05 needs investigating; ``docs/guides/dtensor-tp-accuracy.md``; its ``grpo.py``
    plots the worst sample above 1.05). 1.0 when no valid token was seen (and whenever pi = mu).
    """

    higher_is_better = False
    empty_value = 1.0

    def _values(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mult_prob_error(delta), mask  # [B, T]


class SequenceMultProbError(LogRatioMeanMetric):
    """``stat`` of each response's mean exp(|delta|) (NeMo-RL ``{max,mean,min}_seq_mult_prob_error``).

    Over the responses with at least one valid token (NeMo-RL likewise). 1.0 when none was seen. The
    per-response value is :func:`sequence_mult_prob_error`, what ``seq_logprob_error_threshold`` compares.
    """

    higher_is_better = False
    empty_value = 1.0

    def __init__(self, stat: str = "max", **kwargs: Any) -> None:
        if stat not in SEQUENCE_STATS:
            raise ValueError(f"stat must be one of {SEQUENCE_STATS}, got {stat!r}")
        super().__init__(**kwargs)
        self.stat = stat
        if stat != "mean":
            init = -math.inf if stat == "max" else math.inf
            self.add_state("extreme", default=torch.tensor(init, dtype=STATE_DTYPE), dist_reduce_fx=stat)

    def _values(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return masked_mean(mult_prob_error(delta), mask, dim=-1), sequence_mask(mask)  # [B]

    def _accumulate(self, values: torch.Tensor, valid: torch.Tensor) -> None:
        super()._accumulate(values, valid)
        if self.stat != "mean":
            fill = -math.inf if self.stat == "max" else math.inf
            candidates = torch.cat([self.extreme.view(1), torch.where(valid, values, fill).flatten()])
            self.extreme = candidates.amax() if self.stat == "max" else candidates.amin()

    def _finalize(self, mean: torch.Tensor) -> torch.Tensor:
        return mean if self.stat == "mean" else self.extreme


class ReverseKL(LogRatioMeanMetric):
    """KL(pi || mu) from tokens sampled by mu: mean of :func:`reverse_kl_terms` over valid tokens.

    ``estimator="is_k3"`` (default): mean(1 - w + w delta), unbiased for KL(pi || mu) (the reverse of
    ``MismatchKL``'s KL(mu || pi)), >= 0. ``estimator="swapped_k3"``: NeMo-RL's ``policy_kl_error``,
    mean(1/w - 1 + delta), whose expectation is chi2(mu || pi) - KL(mu || pi), not KL(pi || mu) (see
    :func:`reverse_kl_terms`). 0.0 when no valid token was seen (and whenever pi = mu).
    """

    higher_is_better = False

    def __init__(self, estimator: str = "is_k3", **kwargs: Any) -> None:
        if estimator not in REVERSE_KL_ESTIMATORS:
            raise ValueError(f"estimator must be one of {REVERSE_KL_ESTIMATORS}, got {estimator!r}")
        super().__init__(**kwargs)
        self.estimator = estimator

    def _values(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return reverse_kl_terms(delta, self.estimator), mask  # [B, T]


class JensenShannon(LogRatioMeanMetric):
    """Jensen-Shannon divergence of pi and mu from tokens sampled by mu: mean of :func:`js_terms`.

    ``estimator="is"`` (default): unbiased for JS(pi, mu) in [0, ln 2], >= 0 per token.
    ``estimator="log_cosh"``: NeMo-RL's ``js_divergence_error``, mean ln cosh(delta / 2), a symmetric
    per-token score equal to NeMo's mixture formula on the sampled token, not an estimator of JS.
    0.0 when no valid token was seen (and whenever pi = mu).
    """

    higher_is_better = False

    def __init__(self, estimator: str = "is", **kwargs: Any) -> None:
        if estimator not in JS_ESTIMATORS:
            raise ValueError(f"estimator must be one of {JS_ESTIMATORS}, got {estimator!r}")
        super().__init__(**kwargs)
        self.estimator = estimator

    def _values(self, delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return js_terms(delta, self.estimator), mask  # [B, T]


class _MomentMetric(Metric):
    """Mean, Bessel-corrected std or max of per-token values over valid tokens, from sum-reduced states (sum, sum
    of squares, count; max), so a sync is exact. Subclasses compute the values in ``update`` and call
    :meth:`_add`. 0.0 when no valid token was seen (std: with fewer than 2)."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    def __init__(self, stat: str, stats: tuple[str, ...], **kwargs: Any) -> None:
        if stat not in stats:
            raise ValueError(f"stat must be one of {stats}, got {stat!r}")
        super().__init__(**kwargs)
        self.stat = stat
        self.add_state("total", default=torch.tensor(0.0, dtype=STATE_DTYPE), dist_reduce_fx="sum")
        self.add_state("total_sq", default=torch.tensor(0.0, dtype=STATE_DTYPE), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("extreme", default=torch.tensor(0.0, dtype=STATE_DTYPE), dist_reduce_fx="max")

    def _add(self, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Accumulate ``values`` (>= 0, float64) at the ``mask`` positions.  # both [B, T]"""
        self.total += masked_sum(values, mask)
        self.total_sq += masked_sum(values * values, mask)
        self.count += mask.sum()
        if values.numel():
            self.extreme = torch.maximum(self.extreme, torch.where(mask, values, 0.0).amax())

    def compute(self) -> torch.Tensor:
        n = self.count.to(STATE_DTYPE)
        if self.stat == "max":
            return self.extreme.clone()
        if self.stat == "mean":
            return self.total / n.clamp(min=1.0)
        var = (self.total_sq - self.total**2 / n.clamp(min=1.0)) / (n - 1.0).clamp(min=1.0)
        return torch.where(n > 1, var.clamp(min=0.0).sqrt(), torch.zeros_like(var))


class ProbabilityDiff(_MomentMetric):
    """verl's ``training/rollout_probs_diff_{mean,max,std}``: |pi_old - mu| of the sampled token (probability).

    Over valid tokens: ``mean``, ``max`` or ``std`` (Bessel-corrected, as ``torch.std`` in verl; 0.0 for
    fewer than 2 tokens). Needs the absolute log-probs (a probability difference is not a function of the
    ratio): ``update(train_logprobs, rollout_logprobs, mask, log_ratio=None)``, where a given ``log_ratio``
    only means "already validated". 0.0 when no valid token was seen. A scale-dependent score: the same
    ratio moves it more on likely tokens; it is no estimator of a divergence.
    """

    def __init__(self, stat: str = "mean", **kwargs: Any) -> None:
        super().__init__(stat, PROBABILITY_DIFF_STATS, **kwargs)

    def update(
        self,
        train_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        log_ratio: torch.Tensor | None = None,
    ) -> None:
        """``log_ratio``: optional precomputed delta; when given the inputs count as validated."""
        if log_ratio is None:
            check_logprob_inputs(train_logprobs, rollout_logprobs, mask)
        diff = (_probabilities(train_logprobs, mask) - _probabilities(rollout_logprobs, mask)).abs()  # [B, T]
        self._add(diff, mask)


class ProbabilityCorrelation(Metric):
    """verl's ``training/rollout_actor_probs_pearson_corr``: Pearson correlation of pi_old and mu per token.

    The correlation over valid tokens of the two probabilities of the sampled token (verl exponentiates
    the log-probs before ``torch.corrcoef``, following MiniMax-M1, arXiv 2506.13585), from six sum-reduced
    states (n, sums, sums of squares and of products), so the synced value is the correlation over all
    ranks' tokens. In [-1, 1]; 1.0 while undefined (fewer than 2 valid tokens, or either side constant to
    rounding, :data:`CONSTANT_TOL`), where verl returns NaN. Needs the absolute log-probs, like
    :class:`ProbabilityDiff`.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in ("sum_x", "sum_y", "sum_xx", "sum_yy", "sum_xy"):
            self.add_state(name, default=torch.tensor(0.0, dtype=STATE_DTYPE), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(
        self,
        train_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        log_ratio: torch.Tensor | None = None,
    ) -> None:
        """``log_ratio``: optional precomputed delta; when given the inputs count as validated."""
        if log_ratio is None:
            check_logprob_inputs(train_logprobs, rollout_logprobs, mask)
        x = _probabilities(train_logprobs, mask)  # [B, T], 0 where masked
        y = _probabilities(rollout_logprobs, mask)  # [B, T]
        self.sum_x += x.sum()
        self.sum_y += y.sum()
        self.sum_xx += (x * x).sum()
        self.sum_yy += (y * y).sum()
        self.sum_xy += (x * y).sum()
        self.count += mask.sum()

    def compute(self) -> torch.Tensor:
        n = self.count.to(STATE_DTYPE).clamp(min=1.0)
        cov = self.sum_xy - self.sum_x * self.sum_y / n
        var_x = (self.sum_xx - self.sum_x**2 / n).clamp(min=0.0)
        var_y = (self.sum_yy - self.sum_y**2 / n).clamp(min=0.0)
        denom = (var_x * var_y).sqrt()
        # a side is constant when its spread is at the rounding level of its sums (n * var <= 1e-10 * sum x^2)
        spread = (var_x > CONSTANT_TOL * self.sum_xx) & (var_y > CONSTANT_TOL * self.sum_yy)
        defined = (self.count > 1) & spread
        r = (cov / torch.where(defined, denom, torch.ones_like(denom))).clamp(-1.0, 1.0)
        return torch.where(defined, r, torch.ones_like(r))


class MismatchKLStatistic(_MomentMetric):
    """prime-rl's ``mismatch_kl/{all,<env>}/{mean,std,max}``: a statistic of the per-token k3 over valid tokens.

    Per token k3 = w - 1 - delta (prime-rl's ``mismatch_kl``, NeMo-RL's ``gen_kl_error`` term); ``stat``:
    ``mean`` (= ``MismatchKL("k3")``), ``std`` (Bessel-corrected, as prime-rl's ``torch.std``; 0.0 for
    fewer than 2 tokens) or ``max``. ``task``: None counts every row; a name counts only the rows whose
    ``tasks`` entry equals it (prime-rl's per-environment split), and then ``update`` needs
    ``tasks``: one name per row (``[B]`` strings). The states (sum, sum of squares, count; max) are the
    same on every rank whatever the tasks there, so a sync never hangs and is exact. 0.0 when no valid
    token was seen.
    """

    def __init__(self, stat: str = "std", task: str | None = None, **kwargs: Any) -> None:
        if stat not in KL_STATS:  # checked first, as before: the message names stat whatever task is
            raise ValueError(f"stat must be one of {KL_STATS}, got {stat!r}")
        if task is not None and (not isinstance(task, str) or not task or "." in task):
            raise ValueError(f"task must be None or a non-empty name without '.', got {task!r}")
        super().__init__(stat, KL_STATS, **kwargs)
        self.task = task

    def update(
        self,
        train_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        log_ratio: torch.Tensor | None = None,
        tasks: Sequence[str] | None = None,
    ) -> None:
        """``log_ratio``: optional precomputed delta; ``tasks``: each row's task name (needed with ``task``)."""
        delta = checked_log_ratio(train_logprobs, rollout_logprobs, mask, log_ratio)  # [B, T]
        if self.task is not None:
            if tasks is None or len(tasks) != mask.shape[0]:
                got = "None" if tasks is None else f"{len(tasks)} names"
                raise ValueError(
                    f"tasks: MismatchKLStatistic(task={self.task!r}) needs one task name per row "
                    f"({mask.shape[0]}), got {got}"
                )
            rows = torch.tensor([t == self.task for t in tasks], dtype=torch.bool, device=mask.device)  # [B]
            mask = mask & rows.unsqueeze(-1)  # [B, T]
        self._add(k3_per_token(delta), mask)  # [B, T]
