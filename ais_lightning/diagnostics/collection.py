"""``MismatchDiagnostics``: one MetricCollection of every metric sharing the log-prob signature."""

from __future__ import annotations

from typing import Any

from torchmetrics import Metric, MetricCollection

from ais_lightning.diagnostics.ais_coefficient import AISCoefficient
from ais_lightning.diagnostics.mismatch import (
    ChiSquare,
    EffectiveSampleSize,
    MismatchKL,
    PerplexityRatio,
    RatioStatistic,
)


def MismatchDiagnostics(prefix: str = "mismatch/", c: float = 2.0, **metric_kwargs: Any) -> MetricCollection:  # noqa: N802
    """All mismatch metrics with ``update(train_logprobs, rollout_logprobs, mask)``, as one collection.

    Stable names (each prefixed with ``prefix``): ``kl_k1``, ``kl_k3``, ``chi2_token``, ``chi2_seq``,
    ``ess``, ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``ratio_frac_above``, ``ratio_frac_below``,
    ``ppl_ratio`` and ``ais_lambda`` (``AISCoefficient``). ``c`` is the clip bound C for the ratio
    fractions and the truncation C of ``ais_lambda`` (other AIS hyper-parameters keep their
    defaults). ``metric_kwargs`` (e.g. ``sync_on_compute``) go to every metric.

    ``collection.update(train_logprobs, rollout_logprobs, mask, advantages=..., entropy=...)`` is
    accepted: torchmetrics passes each metric only the keyword arguments its ``update`` takes.
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
    metrics["ais_lambda"] = AISCoefficient("lambda", c=c, **metric_kwargs)
    return MetricCollection(metrics, prefix=prefix, compute_groups=False)
