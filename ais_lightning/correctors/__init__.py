"""Off-policy correctors for low-precision rollouts: none, TIS, MIS, AIS (design.md sections 1, 3, 4).

```python
from ais_lightning.correctors import AIS
out = AIS()(train_logprobs, rollout_logprobs, mask, advantages=adv)
loss = (out.weights * per_token_loss)[out.mask].sum() / out.mask.sum()
```
Pure torch: every corrector is an ``nn.Module`` with no Lightning import.
"""

from __future__ import annotations

from ais_lightning.correctors.ais import (
    AIS,
    AIS_STATISTICS,
    NUM_AIS_STATISTICS,
    ais_coefficient,
    ais_sufficient_statistics,
    check_ais_args,
)
from ais_lightning.correctors.base import LEVELS, CorrectionOutput, Corrector, RawCorrection, level_ratio
from ais_lightning.correctors.mis import MIS
from ais_lightning.correctors.none import NoCorrection
from ais_lightning.correctors.tis import TIS

CORRECTORS: dict[str, type[Corrector]] = {"none": NoCorrection, "tis": TIS, "mis": MIS, "ais": AIS}
"""Config names of the correctors (``build_corrector``)."""


def build_corrector(name: str, **kwargs) -> Corrector:
    """Instantiate a corrector by config name (``"none"``, ``"tis"``, ``"mis"``, ``"ais"``, any case)."""
    key = name.lower() if isinstance(name, str) else name
    if key not in CORRECTORS:
        raise ValueError(f"unknown corrector name {name!r}; valid names: {sorted(CORRECTORS)}")
    return CORRECTORS[key](**kwargs)


__all__ = [
    "AIS",
    "AIS_STATISTICS",
    "CORRECTORS",
    "LEVELS",
    "MIS",
    "NUM_AIS_STATISTICS",
    "TIS",
    "CorrectionOutput",
    "Corrector",
    "NoCorrection",
    "RawCorrection",
    "ais_coefficient",
    "ais_sufficient_statistics",
    "build_corrector",
    "check_ais_args",
    "level_ratio",
]
