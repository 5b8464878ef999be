"""The fp32 alignment gate (``algorithm.max_fp32_mult_prob_error``): stop a run whose trainer-precision engine
disagrees with the policy, before any update.

At fp32 the engine and the trainer compute the same model, so their log-probs of the same tokens agree up to kernel
rounding; a ``token_mult_prob_error`` (NeMo-RL's acceptance metric of a new model: <= 1.05) above the limit means a
defect in the model code, the weight sync or the log-prob processing, which every later step would train through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ais_lightning import ops
from ais_lightning.diagnostics import TokenMultProbError
from ais_lightning.modules.rollout_engines import generate_outside_training
from ais_lightning.rollout.base import RolloutEngine, SamplingConfig


def fp32_alignment(
    engine: RolloutEngine | None,
    policy: Any,
    prompt_ids: list[list[int]],
    sampling: SamplingConfig,
    limit: float,
    all_ranks_finite: Callable[[torch.Tensor], bool],
) -> dict[str, float]:
    """The trainer-precision ``engine`` samples ``prompt_ids`` as a rollout would; its log-probs are scored against
    ``policy``'s at the same temperature with ``TokenMultProbError`` (over every rank's tokens, so every rank takes the
    same decision). RuntimeError above ``limit``; ValueError without the engine. Returns
    ``{"alignment/fp32_token_mult_prob_error": value}`` to log."""
    if engine is None:
        raise ValueError(
            f"algorithm.max_fp32_mult_prob_error={limit} needs the trainer-precision (fp32) engine, which this "
            "run does not build (validation off, or a rollout engine without an fp32 copy); unset it and check "
            "the model with tools/model_mismatch.py --check instead"
        )
    device = next(policy.parameters()).device
    batch = ops.to_device(generate_outside_training(engine, prompt_ids, sampling), device)
    with torch.no_grad():
        train_logprobs = policy.batch_logprobs(batch, sampling.temperature).logprobs  # [B, T]
    mask = batch.response_mask  # [B, T]
    if not all_ranks_finite(torch.where(mask, train_logprobs + batch.rollout_logprobs, 0.0)):
        raise RuntimeError(
            "algorithm.max_fp32_mult_prob_error: non-finite log-probs from the trainer-precision engine or the "
            "policy on the first rollout step's prompts; the fp32 alignment cannot be measured"
        )
    metric = TokenMultProbError().to(train_logprobs.device)
    metric.update(train_logprobs, batch.rollout_logprobs, mask)
    value = float(metric.compute())
    if not value <= limit:
        raise RuntimeError(
            f"fp32 alignment check failed: token_mult_prob_error of the trainer-precision engine against the "
            f"policy is {value:.6g} > algorithm.max_fp32_mult_prob_error={limit} (NeMo-RL accepts a new model "
            "at <= 1.05). At fp32 both sides compute the same model, so the gap is in the model code, the weight "
            "sync or the log-prob processing (temperature, masking): compare with tools/model_mismatch.py "
            "--check, or raise or unset algorithm.max_fp32_mult_prob_error"
        )
    return {"alignment/fp32_token_mult_prob_error": value}
