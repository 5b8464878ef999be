"""pi_v: the trainer-precision log-probs of each row under the weights that generated it.

The split of the mismatch (:mod:`ais_lightning.staleness.split`) needs, for every stale row, the log-prob of its
tokens under the trainer's policy at the row's generating version ``v``. Two ways were open: ask the engine to
score its own samples at the trainer's precision (it would need an fp32 copy of every version it generated with)
or keep the trainer's weights of the last ``max_staleness`` versions and score with them. The second is what this
module does, on the trainer's side, so that the in-process source and remote rollout workers share it: one
unsharded copy of the policy (its parameters swapped in per version) and one no-grad forward per step over the
stale rows (at most one extra forward of the batch: about a third of an update's compute; fresh rows reuse
pi_prox, which they equal).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ais_lightning.policy.gather import load_named_tensors
from ais_lightning.rollout.base import RolloutBatch
from ais_lightning.staleness import WeightSnapshots


class VersionScorer:
    """Scores rollout rows with the trainer's policy at their generating versions.

    Args:
        policy: the trainer's ``ais_lightning.policy.Policy`` (copied once, unsharded, before any sharding; the
            copy is not a registered submodule, so it is neither trained nor checkpointed).
    """

    def __init__(self, policy: Any) -> None:
        self.policy = copy.deepcopy(policy).requires_grad_(False)
        self._loaded: int | None = None

    @torch.no_grad()
    def logprobs(
        self,
        batch: RolloutBatch,
        versions: torch.Tensor,
        current: int,
        current_logprobs: torch.Tensor,
        snapshots: WeightSnapshots,
        temperature: float,
    ) -> torch.Tensor:
        """log pi_v of every response token (``[B, T]``): ``current_logprobs`` (pi_prox) on rows of version
        ``current``, the copy's log-probs with the weights of ``snapshots.get(v)`` on rows of an older ``v``."""
        out = current_logprobs.detach().clone()  # [B, T]
        for version in sorted({int(v) for v in versions.tolist()} - {current}):
            rows = torch.nonzero(versions == version).flatten()  # [R]
            if self._loaded != version:
                load_named_tensors(self.policy.model, snapshots.get(version))
                self._loaded = version
            self.policy.to(current_logprobs.device)
            part = batch.rows(rows.to(batch.response_ids.device))
            out[rows] = self.policy.batch_logprobs(part, temperature).logprobs.to(out.dtype)  # [R, T]
        return out
