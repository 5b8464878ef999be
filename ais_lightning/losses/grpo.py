"""GRPO / PPO clipped policy-gradient loss with importance-sampling correction.

Surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347) with
the asymmetric clip of DAPO (Yu et al. 2025, arXiv 2503.14476), per valid token::

    r  = exp(log pi_theta - log pi_old)
    pg = -min(r * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A)
    pg = min(pg, -dual_clip * A)            if A < 0 and dual_clip is set
    loss = agg(weights * pg) + kl_coef * agg(v * k3(pi_theta, ref)) - entropy_coef * agg(entropy)
           + mismatch_penalty_coef * agg((log pi_theta - log mu)^2)      (prime-rl's penalty, off by default)
    v = 1 (kl_ratio="none"), pi_theta / pi_old ("old") or pi_theta / mu ("rollout")

Dual clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL" (arXiv 1912.09729);
verl's ``clip_ratio_c``. It bounds the loss of a negative-advantage token whose ratio has exploded.
k3 KL estimator (Schulman 2020, "Approximating KL Divergence"): ``exp(ref - logp) - (ref - logp) - 1``,
an unbiased, non-negative per-token estimate of KL(pi_theta || ref) under samples from pi_theta.

The rollout's tokens are sampled by mu, not pi_theta, so k3 alone estimates E_mu[k3], not the KL.
``kl_ratio`` weights it by an importance ratio v (DeepSeek-V3.2's "unbiased KL estimate", arXiv
2512.02556), computed from pi_theta *with* its gradient, as all three peers do: per token the gradient
of v * k3 is then v * log(pi_theta / ref) * grad log pi_theta (score-function term included), whose
expectation under mu is the gradient of KL(pi_theta || ref) when v = pi_theta / mu:

* ``"rollout"``: v = pi_theta / mu, the ratio to the policy that sampled the tokens: E_mu[v k3] =
  KL(pi_theta || ref) exactly. NeMo-RL ``use_on_policy_kl_approximation`` (``nemo_rl/algorithms/loss/
  loss_functions.py``: ``exp(curr_logprobs - generation_logprobs)``); slime ``--use-unbiased-kl`` with
  ``--use-rollout-logprobs``.
* ``"old"``: v = pi_theta / pi_old. TRL ``use_bias_correction_kl`` (``trl/trainer/grpo_trainer.py``:
  ``coef_1 = exp(per_token_logps - old_per_token_logps)``, token level; TRL's ``old_per_token_logps`` is the
  trainer's, its rollout mismatch is corrected separately) and slime ``--use-unbiased-kl``
  (``slime/backends/megatron_utils/loss.py``: ``exp(log_probs - old_log_probs)``, the trainer's old
  log-probs by default). It corrects the drift of pi_theta over several updates, not the rollout
  mismatch pi_old / mu. In bypass mode pi_old is mu, so "old" is "rollout".

Clamps of the k3 term (:func:`reference_k3`): the log-ratio log(ref / pi_theta) is clamped to +-20 (as NeMo-RL's
``kl_input_clamp_value`` = 20). ``kl_clamp`` adds NeMo-RL's other two (``nemo_rl/algorithms/utils.py``,
``calculate_kl``): the weighted term v * k3 clamped to [-kl_clamp, kl_clamp] (NeMo's ``kl_output_clamp_value``,
default 10), and v detached on the tokens where the +-20 clamp binds. Off (None, the default) the two differ from
NeMo's on exactly the tokens with v * k3 > kl_clamp: NeMo counts kl_clamp and no gradient there, we count v * k3
with its gradient (at kl_clamp = 10 and v = 1: ref / pi_theta above 13.6 or below e^-11); and where the +-20 clamp
binds with v * k3 <= kl_clamp, NeMo drops v's gradient and we keep it. Elsewhere the values and gradients agree.

Two ways to use the rollout policy mu (the low-precision engine), following verl's rollout
correction docs ("decoupled" vs "bypass" mode) and Fu et al. 2025, "AReaL" (arXiv 2505.24298),
decoupled PPO:

* ``mode="decoupled"`` (three policies): ``old_logprobs`` is pi_old, recomputed by the high-precision
  trainer before the update; the PPO ratio pi_theta / pi_old is clipped (the trust region), and the
  off-policy correction pi_old / mu comes from a corrector (TIS/MIS/AIS) as ``weights``, multiplied
  into the per-token loss *after* clipping (the IS weight is not part of the trust region).
* ``mode="bypass"`` (two policies): the old policy is mu itself (``rollout_logprobs`` when given, else
  the caller passes mu as ``old_logprobs``), so the clipped ratio pi_theta / mu is itself the importance
  ratio and there is no separate IS weight: ``weights`` must be None or 1 on every valid token (what
  ``NoCorrection`` returns), anything else raises ValueError. A corrector may still reject tokens via
  ``mask``.

Every policy loss of this package shares one call signature (``ais_lightning.losses.PolicyLoss``), so
a training loop passes the same inputs whichever loss it holds.

``mask`` defines which tokens enter the loss *and* its denominator: pass
``response_mask & corrector_output.mask`` so tokens rejected by MIS leave the mean (slime #657).
"""

from __future__ import annotations

import math

import torch

from ais_lightning.losses.base import LossOutput, PolicyLoss
from ais_lightning.losses.penalties import squared_log_ratio_penalty
from ais_lightning.ops import LOG_RATIO_CLAMP, check_mask, check_token_tensor, masked_mean, masked_sum

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
MODES = ("decoupled", "bypass")
KL_RATIOS = ("none", "old", "rollout")


def aggregate(
    x: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    max_response_length: int | None = None,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``x`` [B, T] over valid tokens to a scalar.

    * ``token-mean``: ``sum_valid x / n_valid_tokens``.
    * ``seq-mean-token-mean``: mean over sequences with >= 1 valid token of each sequence's token mean
      (sequences without valid tokens, e.g. fully rejected by MIS, leave the denominator).
    * ``seq-mean-token-sum-norm`` (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783): each sequence's token
      sum divided by the constant ``max_response_length``, mean over all B sequences.

    ``denominator`` replaces the token count (token-mean) or sequence count (the other two) so that
    micro-batches of one mini-batch, each divided by the mini-batch's count, sum to the mini-batch loss.
    No valid tokens gives 0, still connected to the graph of ``x``.
    """
    if aggregation == "token-mean":
        total = masked_sum(x, mask)
        count = mask.sum()
    elif aggregation == "seq-mean-token-mean":
        seq_mean = masked_mean(x, mask, dim=-1)  # [B]
        total = seq_mean.sum()
        count = mask.any(dim=-1).sum()
    elif aggregation == "seq-mean-token-sum-norm":
        if max_response_length is None:
            raise ValueError("aggregation='seq-mean-token-sum-norm' requires max_response_length")
        total = masked_sum(x, mask) / max_response_length
        count = torch.tensor(mask.shape[0], device=x.device)
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if denominator is not None:
        return total / torch.as_tensor(denominator, device=x.device).to(x.dtype)
    return total / count.clamp(min=1).to(x.dtype)


def aggregation_count(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The count :func:`aggregate` divides by for ``mask`` ``[B, T]``, at least 1 (a 0-dim long tensor)."""
    if aggregation == "token-mean":
        count = mask.sum()
    elif aggregation == "seq-mean-token-mean":
        count = mask.any(dim=-1).sum()
    elif aggregation == "seq-mean-token-sum-norm":
        count = torch.tensor(mask.shape[0], device=mask.device)
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    return count.clamp(min=1)


def check_policy_loss_inputs(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Validate the inputs every policy loss shares; returns ``advantages`` broadcast to ``[B, T]``.

    ``advantages`` may be ``[B]`` (one per sequence) or ``[B, T]``; errors name the tensor.
    """
    check_mask(mask)
    check_token_tensor(logprobs, "logprobs", mask)
    check_token_tensor(old_logprobs, "old_logprobs", mask)
    if isinstance(advantages, torch.Tensor) and advantages.dim() == 1:
        if advantages.shape[0] != mask.shape[0]:
            raise ValueError(
                f"advantages has shape {tuple(advantages.shape)}; expected [B]={mask.shape[0]} or [B, T]"
            )
        advantages = advantages.unsqueeze(-1).expand(mask.shape)  # [B, T]
    check_token_tensor(advantages, "advantages", mask)
    return advantages


def importance_ratio(logprobs: torch.Tensor, base_logprobs: torch.Tensor) -> torch.Tensor:
    """exp(clamp(logprobs - base_logprobs, +-20)), differentiable in ``logprobs``.  # [B, T]

    The weight of ``GRPOLoss``'s importance-weighted KL (``kl_ratio``): ``logprobs`` = log pi_theta (with
    grad), ``base_logprobs`` = log pi_old or log mu (detached by the caller). Not detached on purpose:
    the gradient of v * k3 then carries the score-function term of the sampling distribution (NeMo-RL,
    TRL and slime keep it too).
    """
    return torch.exp((logprobs - base_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def reference_k3(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    weight: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """The k3 estimate of KL(pi_theta || ref) per token, ``weight`` * k3 when a weight is given.  # [B, T]

    k3 = exp(r) - r - 1 with r = clamp(log ref - log pi_theta, +-20) (Schulman 2020), >= 0. ``clamp`` (NeMo-RL's
    ``calculate_kl`` with ``kl_output_clamp_value``): the result is clamped to [-clamp, clamp], and ``weight`` is
    detached on the tokens where the +-20 clamp of r binds (its gradient would multiply a clamped k3). None: no
    output clamp, ``weight`` keeps its gradient everywhere.
    """
    raw = ref_logprobs - logprobs  # [B, T]
    log_ref_ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    k3 = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0  # [B, T], >= 0
    if weight is not None:
        if clamp is not None:
            weight = torch.where(raw == log_ref_ratio, weight, weight.detach())
        k3 = weight * k3  # [B, T]
    return k3 if clamp is None else k3.clamp(-clamp, clamp)


def check_identity_weights(weights: torch.Tensor, mask: torch.Tensor, loss_name: str) -> None:
    """Raise ValueError unless ``weights`` is 1 on every valid token (``NoCorrection``'s output).

    For losses that correct the rollout mismatch themselves: real IS weights would be silently
    dropped or counted twice, so they are refused with the way out named.
    """
    if not bool(torch.where(mask, weights == 1, True).all()):
        raise ValueError(
            f"weights: {loss_name} corrects the rollout mismatch itself and takes no importance weights; "
            "use corrector=none (NoCorrection) with it"
        )


def masked_as(x: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` with masked positions zeroed *before* any math, so padding (-inf, NaN) cannot leak into
    gradients.  # [B, T]"""
    x = x.to(dtype)
    return torch.where(mask, x, torch.zeros_like(x))  # [B, T]


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, ``-min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A)``, bounded by
    ``-dual_clip * A`` where ``A < 0`` (module docstring); returns ``(pg, clipped, dual_active)``, each ``[B, T]``:
    the per-token loss, where the clipped branch is taken and where the dual clip is active (valid tokens only).
    ``ratio`` and ``advantages`` ``[B, T]``, masked positions zeroed."""
    pg_unclipped = -advantages * ratio  # [B, T]
    pg_clipped = -advantages * ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)  # [B, T]
    pg = torch.maximum(pg_unclipped, pg_clipped)  # [B, T]
    clipped = (pg_clipped > pg_unclipped) & mask  # [B, T]
    if dual_clip is None:
        return pg, clipped, torch.zeros_like(mask)
    pg_dual = -advantages * dual_clip  # [B, T]
    dual_active = (advantages < 0) & (pg > pg_dual) & mask  # [B, T]
    return torch.where(dual_active, pg_dual, pg), clipped, dual_active  # [B, T] each


def clip_stats(
    ratio: torch.Tensor, clipped: torch.Tensor, dual_active: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """``loss/pg_clipfrac``, ``loss/pg_clipfrac_lower``, ``loss/ratio_mean`` and ``loss/ratio_max`` over the valid
    tokens of ``mask`` (0 when there are none), from :func:`clipped_surrogate`'s outputs."""
    with torch.no_grad():
        n_valid = mask.sum().clamp(min=1)
        return {
            "loss/pg_clipfrac": (clipped.sum() / n_valid).item(),
            "loss/pg_clipfrac_lower": (dual_active.sum() / n_valid).item(),
            "loss/ratio_mean": masked_mean(ratio, mask).item(),
            "loss/ratio_max": ratio[mask].max().item() if bool(mask.any()) else 0.0,
        }


class GRPOLoss(PolicyLoss):
    """PPO-clip policy-gradient loss for GRPO with IS weights, k3 KL and entropy bonus.

    Args:
        epsilon_low: lower clip, ratio >= 1 - epsilon_low; in [0, 1].
        epsilon_high: upper clip, ratio <= 1 + epsilon_high; >= 0. Default 0.28, DAPO's clip-higher
            (arXiv 2503.14476): a wider upper range keeps low-probability tokens explorable.
        dual_clip: dual-clip constant c > 1 for negative advantages, or None to disable.
        kl_coef: weight of the k3 KL(pi_theta || ref) penalty; >= 0 (needs ``ref_logprobs`` when > 0).
        kl_ratio: importance ratio weighting the k3 term (module docstring): ``"none"`` (standard GRPO),
            ``"old"`` (pi_theta / pi_old: TRL ``use_bias_correction_kl``, slime ``--use-unbiased-kl``) or
            ``"rollout"`` (pi_theta / mu: NeMo-RL ``use_on_policy_kl_approximation``; needs
            ``rollout_logprobs``). Unbiased for KL(pi_theta || ref) on mu's samples only with ``"rollout"``.
        kl_clamp: None (default) or NeMo-RL's clamps of the k3 term (module docstring; NeMo's default 10): v * k3
            clamped to at most ``kl_clamp`` and v detached where the +-20 log-ratio clamp binds; > 0.
        entropy_coef: weight of the entropy bonus (subtracted); >= 0 (needs ``entropy`` when > 0).
        aggregation: one of ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``.
        max_response_length: the constant normalizer of ``seq-mean-token-sum-norm``.
        mode: ``decoupled`` or ``bypass`` (see the module docstring).
        mismatch_penalty_coef: weight of prime-rl's penalty ``(log pi_theta - log mu)^2`` on every token of
            ``mask`` (``ais_lightning.losses.penalties``; prime-rl's default is 1e-3, used with
            ``DPPOMask``); >= 0, needs ``rollout_logprobs`` when > 0.

    Stats (floats): ``loss/pg_loss``, ``loss/kl`` (the weighted term with ``kl_ratio``, whose ratio's mean
    over valid tokens is ``loss/kl_ratio_mean``) and ``loss/entropy`` are aggregated like the loss
    (with ``denominator`` they are this call's share: sum them over micro-batches), so
    ``loss/total = pg_loss + kl_coef * kl - entropy_coef * entropy``. ``loss/pg_clipfrac`` (the clipped
    branch of the min is taken), ``loss/pg_clipfrac_lower`` (the dual clip is active), ``loss/ratio_mean``
    and ``loss/ratio_max`` are over this call's valid tokens (0 when there are none).
    """

    def __init__(
        self,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.28,
        dual_clip: float | None = None,
        kl_coef: float = 0.0,
        entropy_coef: float = 0.0,
        aggregation: str = "token-mean",
        max_response_length: int | None = None,
        mode: str = "decoupled",
        mismatch_penalty_coef: float = 0.0,
        kl_ratio: str = "none",
        kl_clamp: float | None = None,
    ) -> None:
        super().__init__()
        if not (0.0 <= epsilon_low <= 1.0):
            raise ValueError(f"epsilon_low must be in [0, 1], got {epsilon_low}")
        if not (0.0 <= epsilon_high < math.inf):
            raise ValueError(f"epsilon_high must be a finite value >= 0, got {epsilon_high}")
        if dual_clip is not None and not (1.0 < dual_clip < math.inf):
            raise ValueError(f"dual_clip must be a finite value > 1 (or None), got {dual_clip}")
        if not (0.0 <= kl_coef < math.inf):
            raise ValueError(f"kl_coef must be a finite value >= 0, got {kl_coef}")
        if not (0.0 <= entropy_coef < math.inf):
            raise ValueError(f"entropy_coef must be a finite value >= 0, got {entropy_coef}")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if aggregation == "seq-mean-token-sum-norm" and max_response_length is None:
            raise ValueError("aggregation='seq-mean-token-sum-norm' requires max_response_length")
        if max_response_length is not None and (
            isinstance(max_response_length, bool)
            or not isinstance(max_response_length, int)
            or max_response_length < 1
        ):
            raise ValueError(f"max_response_length must be a positive int, got {max_response_length!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not (0.0 <= mismatch_penalty_coef < math.inf):
            raise ValueError(
                f"mismatch_penalty_coef must be a finite value >= 0, got {mismatch_penalty_coef}"
            )
        self.epsilon_low = float(epsilon_low)
        self.epsilon_high = float(epsilon_high)
        self.trust_region = min(self.epsilon_low, self.epsilon_high)  # the tighter side of the clip
        self.dual_clip = None if dual_clip is None else float(dual_clip)
        self.kl_coef = float(kl_coef)
        self.entropy_coef = float(entropy_coef)
        self.aggregation = aggregation
        self.max_response_length = max_response_length
        self.mode = mode
        self.mismatch_penalty_coef = float(mismatch_penalty_coef)
        if kl_ratio not in KL_RATIOS:
            raise ValueError(f"kl_ratio must be one of {KL_RATIOS}, got {kl_ratio!r}")
        self.kl_ratio = kl_ratio
        if kl_clamp is not None and (
            isinstance(kl_clamp, bool)
            or not isinstance(kl_clamp, (int, float))
            or not 0 < kl_clamp < math.inf
        ):
            raise ValueError(f"kl_clamp must be None or a finite number > 0, got {kl_clamp!r}")
        self.kl_clamp = None if kl_clamp is None else float(kl_clamp)

    def extra_repr(self) -> str:
        return (
            f"epsilon_low={self.epsilon_low}, epsilon_high={self.epsilon_high}, dual_clip={self.dual_clip}, "
            f"kl_coef={self.kl_coef}, entropy_coef={self.entropy_coef}, aggregation={self.aggregation!r}, "
            f"max_response_length={self.max_response_length}, mode={self.mode!r}, "
            f"mismatch_penalty_coef={self.mismatch_penalty_coef}, kl_ratio={self.kl_ratio!r}, "
            f"kl_clamp={self.kl_clamp}"
        )

    @property
    def needs_entropy(self) -> bool:
        """Whether ``forward`` needs ``entropy`` (an entropy bonus is on)."""
        return self.entropy_coef > 0

    @property
    def needs_reference(self) -> bool:
        """Whether ``forward`` needs ``ref_logprobs`` (a KL penalty is on: keep a frozen reference)."""
        return self.kl_coef > 0

    @property
    def own_correction(self) -> str | None:
        """How the loss handles the rollout mismatch itself (then it takes no IS weights), or None."""
        if self.mode == "bypass":
            return (
                "loss.mode=bypass uses pi_old := mu (the clipped ratio pi_theta/mu is the importance ratio)"
            )
        return None

    def _aggregate(self, x: torch.Tensor, mask: torch.Tensor, denominator) -> torch.Tensor:
        return aggregate(x, mask, self.aggregation, self.max_response_length, denominator)

    def denominator(
        self,
        mask: torch.Tensor,
        old_logprobs: torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The count the aggregation divides a batch with ``mask`` ``[B, T]`` by (at least 1): its valid
        tokens (``token-mean``), its sequences with a valid token (``seq-mean-token-mean``) or all its
        sequences (``seq-mean-token-sum-norm``). Micro-batches of the batch that each pass it as
        ``denominator`` have losses that add up to the batch's loss (gradient accumulation)."""
        return aggregation_count(mask, self.aggregation)

    def forward(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        denominator: float | torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
    ) -> LossOutput:
        """Loss and stats for one (micro-)batch.

        Args:
            logprobs: ``[B, T]`` log pi_theta of the sampled tokens, with grad.
            old_logprobs: ``[B, T]`` log pi_old from the trainer (in bypass mode without
                ``rollout_logprobs``: log mu); detached here.
            advantages: ``[B]`` (one per sequence) or ``[B, T]``; detached here.
            mask: ``[B, T]`` bool, tokens in the loss and its denominator.
            weights: ``[B, T]`` non-negative IS weights from a corrector; detached. In bypass mode only
                None or identity weights (1 on every valid token) are accepted.
            ref_logprobs: ``[B, T]`` reference-policy log-probs for the KL penalty.
            entropy: ``[B, T]`` token entropies of pi_theta for the bonus (keeps its grad).
            denominator: positive count replacing the aggregation's token/sequence count.
            rollout_logprobs: ``[B, T]`` log mu from the rollout engine; the old policy in bypass mode,
                unused in decoupled mode (the corrector's ``weights`` carry pi_old/mu there).
        """
        advantages, weights, old_logprobs = self._checked_inputs(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            weights,
            ref_logprobs,
            entropy,
            denominator,
            rollout_logprobs,
        )
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        logp = masked_as(logprobs, mask, dtype)  # [B, T], grad
        old = masked_as(old_logprobs.detach(), mask, dtype)  # [B, T]
        adv = masked_as(advantages.detach(), mask, dtype)  # [B, T]

        ratio = torch.exp((logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]
        pg, clipped, dual_active = clipped_surrogate(
            ratio, adv, mask, self.epsilon_low, self.epsilon_high, self.dual_clip
        )  # [B, T] each
        if weights is not None:
            pg = pg * masked_as(weights.detach(), mask, dtype)  # [B, T], IS weight after clipping

        pg_loss = self._aggregate(pg, mask, denominator)
        loss = pg_loss
        stats: dict[str, float] = {"loss/pg_loss": pg_loss.item()}
        if ref_logprobs is not None:
            kl = self._reference_kl(logp, old, ref_logprobs, rollout_logprobs, mask, denominator, stats)
            if self.kl_coef > 0:
                loss = loss + self.kl_coef * kl
        if self.mismatch_penalty_coef > 0:
            penalty = self._aggregate(
                squared_log_ratio_penalty(logp, rollout_logprobs, mask), mask, denominator
            )
            stats["loss/mismatch_penalty"] = penalty.item()
            loss = loss + self.mismatch_penalty_coef * penalty
        if entropy is not None:
            ent = self._aggregate(masked_as(entropy, mask, dtype), mask, denominator)
            stats["loss/entropy"] = ent.item()
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * ent

        stats.update(clip_stats(ratio, clipped, dual_active, mask))
        stats["loss/total"] = loss.item()
        shares = frozenset(("loss/pg_loss", "loss/kl", "loss/mismatch_penalty", "loss/entropy", "loss/total"))
        return LossOutput(loss=loss, stats=stats, shares=shares & stats.keys())

    def _checked_inputs(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
        entropy: torch.Tensor | None,
        denominator: float | torch.Tensor | None,
        rollout_logprobs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Check :meth:`forward`'s inputs against the loss's options (ValueError naming the tensor); returns the
        advantages broadcast to ``[B, T]``, the IS weights (None in bypass mode, whose identity weights are
        refused otherwise) and the old policy's log-probs (mu's in bypass mode when ``rollout_logprobs`` is given)."""
        advantages = check_policy_loss_inputs(logprobs, old_logprobs, advantages, mask)  # [B, T]
        if weights is not None:
            check_token_tensor(weights, "weights", mask)
            if self.mode == "bypass":
                check_identity_weights(weights, mask, "GRPOLoss(mode='bypass')")
                weights = None
            elif bool((weights[mask] < 0).any()):
                raise ValueError("weights has negative values on valid tokens; IS weights must be >= 0")
        if self.mode == "bypass" and rollout_logprobs is not None:
            check_token_tensor(rollout_logprobs, "rollout_logprobs", mask)
            old_logprobs = rollout_logprobs
        if ref_logprobs is not None:
            check_token_tensor(ref_logprobs, "ref_logprobs", mask)
            if self.kl_ratio == "rollout":
                if rollout_logprobs is None:
                    raise ValueError(
                        "rollout_logprobs is required with kl_ratio='rollout' (the KL's weight is pi_theta / mu)"
                    )
                check_token_tensor(rollout_logprobs, "rollout_logprobs", mask)
        elif self.kl_coef > 0:
            raise ValueError(f"ref_logprobs is required when kl_coef={self.kl_coef} > 0")
        if entropy is not None:
            check_token_tensor(entropy, "entropy", mask)
        elif self.entropy_coef > 0:
            raise ValueError(f"entropy is required when entropy_coef={self.entropy_coef} > 0")
        if denominator is not None and not bool(torch.as_tensor(denominator) > 0):
            raise ValueError(f"denominator must be > 0, got {denominator}")
        if self.mismatch_penalty_coef > 0 and rollout_logprobs is None:
            raise ValueError(
                f"rollout_logprobs is required when mismatch_penalty_coef={self.mismatch_penalty_coef}"
            )
        return advantages, weights, old_logprobs

    def _reference_kl(
        self,
        logp: torch.Tensor,
        old: torch.Tensor,
        ref_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor | None,
        mask: torch.Tensor,
        denominator: float | torch.Tensor | None,
        stats: dict[str, float],
    ) -> torch.Tensor:
        """The aggregated k3 KL(pi_theta || ref) term, weighted by ``kl_ratio``'s importance ratio; records
        ``loss/kl`` (and ``loss/kl_ratio_mean``) in ``stats``. ``logp`` / ``old``: masked, in the loss's dtype."""
        kl_weight = None
        if self.kl_ratio != "none":
            base = old if self.kl_ratio == "old" else masked_as(rollout_logprobs.detach(), mask, logp.dtype)
            kl_weight = importance_ratio(logp, base)  # [B, T], with grad through logp
            stats["loss/kl_ratio_mean"] = masked_mean(kl_weight.detach(), mask).item()
        ref = masked_as(ref_logprobs.detach(), mask, logp.dtype)  # [B, T]
        k3 = reference_k3(logp, ref, kl_weight, self.kl_clamp)  # [B, T], weighted, clamped with kl_clamp
        kl = self._aggregate(k3, mask, denominator)
        stats["loss/kl"] = kl.item()
        return kl
