"""Off-policy correctors for low-precision rollouts: none, TIS, MIS, AIS (docs/design.md sections 1, 3, 4).

```python
from ais_lightning.correctors import AIS
out = AIS()(train_logprobs, rollout_logprobs, mask, advantages=adv)
loss = (out.weights * per_token_loss)[out.mask].sum() / out.mask.sum()
```
Pure torch: every corrector is an ``nn.Module`` with no Lightning import.
"""

from __future__ import annotations

from ais_lightning.checks import registered
from ais_lightning.correctors.ais import (
    AIS,
    AIS_STATISTICS,
    NUM_AIS_STATISTICS,
    AISParams,
    ais_coefficient,
    ais_params,
    ais_sufficient_statistics,
)
from ais_lightning.correctors.ais_v1 import AISv1, AISv1Params
from ais_lightning.correctors.base import LEVELS, CorrectionOutput, Corrector, RawCorrection, level_ratio
from ais_lightning.correctors.batch_norm import BatchNormalizedTIS, batch_normalize
from ais_lightning.correctors.dppo import DPPOMask
from ais_lightning.correctors.icepop import IcePop
from ais_lightning.correctors.m2po import M2PO, m2po_cut
from ais_lightning.correctors.mis import MIS
from ais_lightning.correctors.none import NoCorrection
from ais_lightning.correctors.offpolicy_mask import OffPolicySequenceMask
from ais_lightning.correctors.psis import KHAT_UNRELIABLE, PSIS, gpd_fit, pareto_khat
from ais_lightning.correctors.rejection import RS_OPTIONS, DivergenceRejection
from ais_lightning.correctors.tis import TIS
from ais_lightning.correctors.vespo import VESPO

CORRECTORS: dict[str, type[Corrector]] = {
    "none": NoCorrection,
    "tis": TIS,
    "mis": MIS,
    "ais": AIS,
    "ais_v1": AISv1,
    # the peers' correctors; docs/correctors.md maps each to its peer
    "rs": DivergenceRejection,
    "tis_bn": BatchNormalizedTIS,
    "icepop": IcePop,
    "opsm": OffPolicySequenceMask,
    "dppo": DPPOMask,
    "vespo": VESPO,
    "m2po": M2PO,
    "psis": PSIS,
}
"""The registry of correctors: config name -> class (``build_corrector``; ``ais-train`` generates the schema
``schema/corrector/<name>`` of each; docs/design.md, "Adding a corrector")."""


def build_corrector(name: str, **kwargs) -> Corrector:
    """Instantiate a corrector by config name (``"none"``, ``"tis"``, ``"mis"``, ``"ais"``, any case)."""
    key = name.lower() if isinstance(name, str) else name
    return registered(CORRECTORS, key, "corrector")(**kwargs)


__all__ = [
    "AIS",
    "AIS_STATISTICS",
    "AISParams",
    "AISv1",
    "AISv1Params",
    "CORRECTORS",
    "KHAT_UNRELIABLE",
    "LEVELS",
    "M2PO",
    "MIS",
    "NUM_AIS_STATISTICS",
    "PSIS",
    "RS_OPTIONS",
    "TIS",
    "VESPO",
    "BatchNormalizedTIS",
    "CorrectionOutput",
    "Corrector",
    "DPPOMask",
    "DivergenceRejection",
    "IcePop",
    "NoCorrection",
    "OffPolicySequenceMask",
    "RawCorrection",
    "ais_coefficient",
    "ais_params",
    "ais_sufficient_statistics",
    "batch_normalize",
    "build_corrector",
    "gpd_fit",
    "level_ratio",
    "m2po_cut",
    "pareto_khat",
]
