"""Asynchronous GRPO's bookkeeping, as pure code: policy versions, staleness, the two sources of mismatch.

- :func:`staleness_stats`, :func:`generating_version` (versions.py): the staleness of rows stamped with the policy
  version that generated them (``ais_lightning.rollout.sources.VersionedRollouts``); the bound with ``wait`` /
  ``drop``.
- :class:`WeightSnapshots` (snapshots.py): the trainer's weights of the last versions.
- :func:`split_log_ratio`, :class:`MismatchSplit` (split.py): log(pi_prox / mu) = log(pi_v / mu) (precision)
  + log(pi_prox / pi_v) (staleness), with KL, chi^2 and ESS of each part.
- :class:`AdaptiveStalenessBound` (adaptive.py): a bound that follows the measured staleness mismatch.

docs/async.md maps these to AReaL's, verl's and NeMo-RL's asynchronous modes.
"""

from ais_lightning.staleness.adaptive import AdaptiveStalenessBound
from ais_lightning.staleness.snapshots import WeightSnapshots
from ais_lightning.staleness.split import PARTS, MismatchSplit, split_log_ratio
from ais_lightning.staleness.versions import (
    STALE_POLICIES,
    check_lag,
    generating_version,
    lag_at,
    staleness_stats,
)

__all__ = [
    "PARTS",
    "STALE_POLICIES",
    "AdaptiveStalenessBound",
    "MismatchSplit",
    "WeightSnapshots",
    "check_lag",
    "generating_version",
    "lag_at",
    "split_log_ratio",
    "staleness_stats",
]
