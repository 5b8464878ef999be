"""``MismatchDiagnostics``: one MetricCollection of every metric sharing the log-prob signature."""

from __future__ import annotations

from typing import Any

from torchmetrics import Metric, MetricCollection

from ais_lightning.correctors.ais import ais_params
from ais_lightning.diagnostics.ais_coefficient import AISCoefficient
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


def MismatchDiagnostics(prefix: str = "mismatch/", c: float = 2.0, **metric_kwargs: Any) -> MetricCollection:  # noqa: N802
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
    (``PSISKHat``, > 0.7: IS unreliable). ``c`` is the clip bound C for the ratio fractions and
    clamps, and the truncation C of ``ais_lambda`` (other AIS hyper-parameters keep their
    defaults). ``metric_kwargs`` (e.g. ``sync_on_compute``) go to every metric.

    ``collection.update(train_logprobs, rollout_logprobs, mask, advantages=..., entropy=..., impurity=...)``
    is accepted: torchmetrics passes each metric only the keyword arguments its ``update`` takes. Pass the
    trainer's ``impurity`` (``ops.impurity_from_logits``) or ``entropy``: without either ``ais_lambda``
    measures the mismatch against a spread of 1 and warns.
    ``compute_groups=False``: torchmetrics merges metrics whose states are equal after the first
    update (e.g. ``kl_k1`` and ``ppl_ratio`` both start from sums that are 0 when pi = mu), which
    would silently make them share one state.
    """
    metrics: dict[str, Metric] = {
        "kl_k1": MismatchKL("k1", **metric_kwargs),
        "kl_k3": MismatchKL("k3", **metric_kwargs),
        "chi2_token": ChiSquare("token", **metric_kwargs),
        "chi2_seq": ChiSquare("sequence", **metric_kwargs),
        "ess": EffectiveSampleSize(**metric_kwargs),
        "ppl_ratio": PerplexityRatio(**metric_kwargs),
    }
    for stat in ("mean", "min", "max", "frac_above", "frac_below"):
        metrics[f"ratio_{stat}"] = RatioStatistic(stat, c=c, **metric_kwargs)
    metrics["ais_lambda"] = AISCoefficient("lambda", params=ais_params(c=c), **metric_kwargs)  # AIS v2
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
    metrics["ratio_std"] = ClippedRatioMoment("std", c=c, **metric_kwargs)
    metrics["ess_clipped"] = ClippedRatioMoment("ess", c=c, **metric_kwargs)
    for stat in ("mean", "std", "max", "min", "max_deviation", "frac_above", "frac_below"):
        metrics[f"seq_ratio_{stat}"] = SequenceRatioStatistic(stat, c=c, **metric_kwargs)
    for stat in ("mean", "max"):
        metrics[f"abs_log_ratio_{stat}"] = AbsLogRatio(stat, **metric_kwargs)
    metrics["psis_khat"] = PSISKHat("token", **metric_kwargs)
    metrics["psis_khat_seq"] = PSISKHat("sequence", **metric_kwargs)
    return MetricCollection(metrics, prefix=prefix, compute_groups=False)
