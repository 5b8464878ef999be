"""The metrics of one GRPO rollout step: the mismatch, its two parts, the entropy, error tokens, MoE routing.

``GRPOModule`` updates them while it builds a step's experience and logs ``compute_and_reset()`` once the step is
done. States are torchmetrics' (sum-reduced), so ``compute`` syncs them across ranks exactly; every rank must
therefore call it (torchmetrics #3199).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ais_lightning.correctors.ais import AISParams
from ais_lightning.diagnostics import ErrorTokenRate, MismatchDiagnostics, RoutingDisagreement, TokenEntropy
from ais_lightning.models.routing import routing_replay_mask
from ais_lightning.rollout.base import RolloutBatch
from ais_lightning.staleness import MismatchSplit


class StepMetrics(nn.Module):
    """``mismatch/*`` (:func:`MismatchDiagnostics`), ``mismatch/precision|staleness/*`` (:class:`MismatchSplit`, only
    ``with_split``), ``train/entropy``, ``errors/repeat_frac`` and ``errors/low_logprob_frac`` (QaRL's error tokens),
    and for a mixture-of-experts policy (``moe_layers`` > 0) ``routing/disagreement[_layer<i>]``: how often the
    trainer's own top-k experts differ from the engine's. ``params``: the hyper-parameters the diagnostics share with
    the run's corrector (``corrector.diagnostic_params()``: its clip bound C, lower bound and AIS's lambda
    parameters), so that a run has one C."""

    def __init__(
        self, moe_layers: int = 0, with_split: bool = False, params: AISParams | None = None
    ) -> None:
        super().__init__()
        self.mismatch = MismatchDiagnostics(prefix="mismatch/", params=params)  # the corrector's C and lambda
        self.split = MismatchSplit(prefix="mismatch/") if with_split else None
        self.entropy = TokenEntropy()
        self.errors = nn.ModuleDict(
            {
                "repeat_frac": ErrorTokenRate("repeat", min_ngram=2),
                "low_logprob_frac": ErrorTokenRate("low_logprob"),
            }
        )
        self.routing = (
            nn.ModuleDict(
                {"disagreement": RoutingDisagreement()}
                | {f"disagreement_layer{i}": RoutingDisagreement(layer=i) for i in range(moe_layers)}
            )
            if moe_layers
            else None
        )

    def update(
        self,
        batch: RolloutBatch,
        train_logprobs: torch.Tensor,
        delta: torch.Tensor,
        advantages: torch.Tensor,
        entropy: torch.Tensor,
        impurity: torch.Tensor,
        stale: Any = None,
        own_routing: torch.Tensor | None = None,
    ) -> None:
        """One step's rollout ``batch``, pi_old (``train_logprobs`` ``[B, T]``) and ``delta`` = its clamped log-ratio
        to mu, the ``advantages``, the trainer's ``entropy`` and ``impurity`` ``[B, T]``; ``stale`` an asynchronous
        step's ``StaleMeasure`` (pi_v for the split, and the staleness part of ``delta``, which
        ``mismatch/ais_lambda`` reads as the AIS corrector does); ``own_routing`` the trainer's own
        ``[B, P + T, L, k]`` experts."""
        version_logprobs = stale.version_logprobs if stale is not None else None
        stale_log_ratio = stale.log_ratio if stale is not None else None
        mask = batch.response_mask  # [B, T]
        self.mismatch.update(
            train_logprobs,
            batch.rollout_logprobs,
            mask,
            advantages=advantages,
            entropy=entropy,
            log_ratio=delta,
            impurity=impurity,
            **({} if stale_log_ratio is None else {"stale_log_ratio": stale_log_ratio}),
        )
        if self.split is not None and version_logprobs is not None:
            self.split.update(train_logprobs, version_logprobs, batch.rollout_logprobs, mask)
        self.entropy.update(entropy, mask)
        self.errors["repeat_frac"].update(batch.response_ids, mask)
        self.errors["low_logprob_frac"].update(train_logprobs, mask)
        if self.routing is not None and batch.routing is not None and own_routing is not None:
            valid = routing_replay_mask(batch.prompt_mask, batch.response_mask)  # [B, P + T]
            for metric in self.routing.values():
                metric.update(batch.routing, own_routing, valid)

    def compute_and_reset(self) -> dict[str, float]:
        """Every value of the step (synced across ranks), then a fresh start for the next step."""
        values: dict[str, Any] = dict(self.mismatch.compute())
        self.mismatch.reset()
        if self.split is not None:
            values.update(self.split.compute())
            self.split.reset()
        values["train/entropy"] = self.entropy.compute()
        self.entropy.reset()
        for name, metric in self.errors.items():
            values[f"errors/{name}"] = metric.compute()
            metric.reset()
        if self.routing is not None:
            for name, metric in self.routing.items():
                values[f"routing/{name}"] = metric.compute()
                metric.reset()
        return {k: float(v) for k, v in values.items()}
