"""``MismatchDiagnostics``: one MetricCollection of every metric sharing the log-prob signature."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchmetrics import Metric, MetricCollection

from ais_lightning.correctors.ais import AISParams, ais_params
from ais_lightning.diagnostics.ais_coefficient import AISCoefficient
from ais_lightning.diagnostics.alignment import (
    JensenShannon,
    MismatchKLStatistic,
    ProbabilityCorrelation,
    ProbabilityDiff,
    ReverseKL,
    SequenceMultProbError,
    TokenMultProbError,
)
from ais_lightning.diagnostics.mismatch import (
    ChiSquare,
    EffectiveSampleSize,
    MismatchKL,
    PerplexityRatio,
    RatioStatistic,
)
from ais_lightning.diagnostics.perplexity import LogPerplexityDiff, SequencePerplexity
from ais_lightning.diagnostics.psis import PSISKHat
from ais_lightning.diagnostics.weights import AbsLogRatio, ClippedRatioMoment, SequenceRatioStatistic


def MismatchDiagnostics(  # noqa: N802
    prefix: str = "mismatch/",
    c: float | None = None,
    tasks: Sequence[str] = (),
    params: AISParams | None = None,
    **metric_kwargs: Any,
) -> MetricCollection:
    """All mismatch metrics with ``update(train_logprobs, rollout_logprobs, mask)``, as one collection.

    Stable names (each prefixed with ``prefix``): ``kl_k1``, ``kl_k3``, ``chi2_token``, ``chi2_seq``,
    ``ess``, ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``ratio_frac_above``, ``ratio_frac_below``,
    ``ppl_ratio`` and ``ais_lambda`` (``AISCoefficient``); the names verl and TRL users know
    (``docs/correctors.md`` maps them): ``train_ppl``, ``train_log_ppl``, ``rollout_ppl``,
    ``rollout_log_ppl`` (``SequencePerplexity``), ``log_ppl_diff``, ``log_ppl_abs_diff``,
    ``log_ppl_diff_max``, ``log_ppl_diff_min``, ``ppl_ratio_seq`` (``LogPerplexityDiff``),
    ``ratio_std``, ``ess_clipped`` (``ClippedRatioMoment``), ``seq_ratio_mean``, ``seq_ratio_std``,
    ``seq_ratio_max``, ``seq_ratio_min``, ``seq_ratio_max_deviation``, ``seq_ratio_frac_above``,
    ``seq_ratio_frac_below`` (``SequenceRatioStatistic``), ``abs_log_ratio_mean``,
    ``abs_log_ratio_max`` (``AbsLogRatio``), and the Pareto k-hat ``psis_khat`` / ``psis_khat_seq``
    (``PSISKHat``, > 0.7: IS unreliable); the alignment metrics of NeMo-RL, verl and prime-rl
    (``ais_lightning.diagnostics.alignment``): ``token_mult_prob_error`` (``TokenMultProbError``),
    ``seq_mult_prob_error_max``, ``_mean``, ``_min`` (``SequenceMultProbError``), ``kl_reverse``
    (``ReverseKL("is_k3")``), ``policy_kl_error`` (``ReverseKL("swapped_k3")``), ``js``
    (``JensenShannon("is")``), ``js_divergence_error`` (``JensenShannon("log_cosh")``),
    ``probs_diff_mean``, ``probs_diff_max``, ``probs_diff_std`` (``ProbabilityDiff``), ``probs_pearson``
    (``ProbabilityCorrelation``), ``kl_k3_std``, ``kl_k3_max`` (``MismatchKLStatistic``). NeMo-RL's
    ``gen_kl_error`` is ``kl_k3``. ``params``: the hyper-parameters shared with the run's corrector
    (``corrector.diagnostic_params()``), so that a run has one clip bound: ``params.c`` is the C of the
    ratio fractions and clamps (``ratio_frac_above``: w > C; ``ratio_frac_below``: w < ``params.c_low``, or
    1/C without one; ``ratio_std``, ``ess_clipped`` clamp to that band; ``seq_ratio_frac_*`` likewise) and
    ``ais_lambda`` is AIS v2's lambda with ``params`` (an ``AIS`` corrector's own: its lambda). Without
    ``params``, ``c`` (default 2.0) with AIS's other defaults; both given must agree. ``tasks``: task names; each adds ``by_task/<task>/kl_k3_mean``, ``_std`` and ``_max``
    (prime-rl's ``mismatch_kl/<env>/...``), and ``update`` then needs ``tasks=`` (one name per row).
    ``metric_kwargs`` (e.g. ``sync_on_compute``) go to every metric.

    ``collection.update(train_logprobs, rollout_logprobs, mask, advantages=..., entropy=..., impurity=...)``
    is accepted: torchmetrics passes each metric only the keyword arguments its ``update`` takes. Pass the
    trainer's ``impurity`` (``ops.impurity_from_logits``) or ``entropy``: without either ``ais_lambda``
    measures the mismatch against a spread of 1 and warns.
    ``compute_groups=False``: torchmetrics merges metrics whose states are equal after the first
    update (e.g. ``kl_k1`` and ``ppl_ratio`` both start from sums that are 0 when pi = mu), which
    would silently make them share one state.

    Example:
        >>> import torch
        >>> from ais_lightning.diagnostics import MismatchDiagnostics
        >>> metrics = MismatchDiagnostics()
        >>> train = torch.log(torch.tensor([[0.5, 0.25]]))  # log pi [B=1, T=2]
        >>> rollout = torch.log(torch.tensor([[0.25, 0.25]]))  # log mu
        >>> metrics.update(train, rollout, torch.ones(1, 2, dtype=torch.bool), entropy=torch.ones(1, 2))
        >>> values = metrics.compute()
        >>> round(values["mismatch/kl_k3"].item(), 4), round(values["mismatch/token_mult_prob_error"].item(), 2)
        (0.1534, 1.5)
    """
    # One piece on purpose: a flat list of the collection's metrics in the order they are logged (its length is the
    # docstring naming each); split, the list would only be harder to read whole.
    if params is None:
        params = ais_params(c=2.0 if c is None else c)
    elif c is not None and float(c) != params.c:
        raise ValueError(f"c={c} disagrees with params.c={params.c}: give one of them")
    c, c_low = params.c, params.c_low
    metrics: dict[str, Metric] = {
        "kl_k1": MismatchKL("k1", **metric_kwargs),
        "kl_k3": MismatchKL("k3", **metric_kwargs),
        "chi2_token": ChiSquare("token", **metric_kwargs),
        "chi2_seq": ChiSquare("sequence", **metric_kwargs),
        "ess": EffectiveSampleSize(**metric_kwargs),
        "ppl_ratio": PerplexityRatio(**metric_kwargs),
    }
    for stat in ("mean", "min", "max", "frac_above", "frac_below"):
        metrics[f"ratio_{stat}"] = RatioStatistic(stat, c=c, c_low=c_low, **metric_kwargs)
    metrics["ais_lambda"] = AISCoefficient("lambda", params=params, **metric_kwargs)  # AIS v2
    for policy in ("train", "rollout"):
        metrics[f"{policy}_ppl"] = SequencePerplexity(policy, **metric_kwargs)
        metrics[f"{policy}_log_ppl"] = SequencePerplexity(policy, log=True, **metric_kwargs)
    for name, stat in (
        ("log_ppl_diff", "mean"),
        ("log_ppl_abs_diff", "abs_mean"),
        ("log_ppl_diff_max", "max"),
        ("log_ppl_diff_min", "min"),
        ("ppl_ratio_seq", "exp_mean"),
    ):
        metrics[name] = LogPerplexityDiff(stat, **metric_kwargs)
    metrics["ratio_std"] = ClippedRatioMoment("std", c=c, c_low=c_low, **metric_kwargs)
    metrics["ess_clipped"] = ClippedRatioMoment("ess", c=c, c_low=c_low, **metric_kwargs)
    for stat in ("mean", "std", "max", "min", "max_deviation", "frac_above", "frac_below"):
        metrics[f"seq_ratio_{stat}"] = SequenceRatioStatistic(stat, c=c, c_low=c_low, **metric_kwargs)
    for stat in ("mean", "max"):
        metrics[f"abs_log_ratio_{stat}"] = AbsLogRatio(stat, **metric_kwargs)
    metrics["psis_khat"] = PSISKHat("token", **metric_kwargs)
    metrics["psis_khat_seq"] = PSISKHat("sequence", **metric_kwargs)
    metrics["token_mult_prob_error"] = TokenMultProbError(**metric_kwargs)
    for stat in ("max", "mean", "min"):
        metrics[f"seq_mult_prob_error_{stat}"] = SequenceMultProbError(stat, **metric_kwargs)
    metrics["kl_reverse"] = ReverseKL("is_k3", **metric_kwargs)
    metrics["policy_kl_error"] = ReverseKL("swapped_k3", **metric_kwargs)
    metrics["js"] = JensenShannon("is", **metric_kwargs)
    metrics["js_divergence_error"] = JensenShannon("log_cosh", **metric_kwargs)
    for stat in ("mean", "max", "std"):
        metrics[f"probs_diff_{stat}"] = ProbabilityDiff(stat, **metric_kwargs)
    metrics["probs_pearson"] = ProbabilityCorrelation(**metric_kwargs)
    for stat in ("std", "max"):
        metrics[f"kl_k3_{stat}"] = MismatchKLStatistic(stat, **metric_kwargs)
    if isinstance(tasks, str):
        raise ValueError(f"tasks must be a sequence of task names, got the string {tasks!r}")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"tasks has duplicate names: {list(tasks)}")
    for task in tasks:
        for stat in ("mean", "std", "max"):
            metrics[f"by_task/{task}/kl_k3_{stat}"] = MismatchKLStatistic(stat, task=task, **metric_kwargs)
    return MetricCollection(metrics, prefix=prefix, compute_groups=False)
