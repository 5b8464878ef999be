"""Coupled regeneration: sample chosen rows again with another engine and the same per-step noise.

Sol-RL (Li, Chen, Xue et al. 2026, "FP4 Explore, BF16 Train: Diffusion Reinforcement Learning via
Efficient Rollout Scaling", arXiv 2604.06916) generates a large candidate pool with a cheap NVFP4
model, keeps the most contrastive candidates by reward and regenerates only those in BF16 from the
*same initial noise*, so the expensive samples land where the cheap ones were found. For an
autoregressive LM the noise of a sample is the uniform its inverse-CDF sampler drew at every step
(:func:`ais_lightning.rollout.sampling.sample_from_logprobs`): a cheap engine generating with a
``[B, T]`` uniform table (``generate(..., uniforms=table)``) records it in ``batch.extras["uniforms"]``,
and :func:`regenerate` hands the chosen rows' noise to a high-precision engine. With the same
context and the same u, the two engines pick the same token unless their CDFs put u in different
tokens; once the tokens differ the contexts differ and the samples go their own ways.

Every token of a regenerated row is drawn from the high-precision engine's own distribution and its
recorded log-prob is that engine's, so against a trainer at the same precision the importance ratio
is 1: no correction for the precision mismatch is needed. Which noise rows are regenerated was chosen
from the cheap rewards, so the kept samples are a selected subset (as in any selective training),
not a fresh group.

Pure functions here: :func:`coupling_agreement` (the probability that one shared uniform picks the same
token from two distributions) and :func:`token_agreement` (how much of a regenerated sample its cheap
twin shares).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ais_lightning.rollout.base import RolloutBatch, SamplingConfig
from ais_lightning.rollout.sampling import check_uniforms

__all__ = ["NOISE_KEY", "coupling_agreement", "regenerate", "supports_coupled_noise", "token_agreement"]

NOISE_KEY = "uniforms"
"""The ``RolloutBatch.extras`` entry holding each row's per-step uniforms, ``[B, T]`` float32."""


def supports_coupled_noise(engine: Any) -> bool:
    """Whether ``engine`` (an instance or class) takes a ``uniforms`` table in ``generate``."""
    import inspect

    generate = getattr(engine, "generate", None)
    if generate is None:
        return False
    try:
        return "uniforms" in inspect.signature(generate).parameters
    except (TypeError, ValueError):
        return False


def regenerate(
    engine: Any, batch: RolloutBatch, rows: torch.Tensor, sampling: SamplingConfig
) -> RolloutBatch:
    """Generate ``batch``'s rows ``rows`` again with ``engine``, each with its recorded per-step noise.

    ``rows``: ``[P, n]`` long, ``n`` rows of ``batch`` that answer the same prompt on each line; the
    result has ``P * n`` rows in that order (groups of ``n`` contiguous, as GRPO needs), with
    ``prompt_index`` carried over from ``batch`` (it still points into the caller's prompt list).
    ``sampling`` gives temperature, truncation, length and stop tokens (use the cheap engine's);
    its ``n`` and ``seed`` are ignored. The noise is ``batch.extras["uniforms"]``, which a
    ``generate(..., uniforms=...)`` call records.
    """
    noise = batch.extras.get(NOISE_KEY) if isinstance(batch.extras, dict) else None
    if noise is None:
        raise ValueError(
            f"batch.extras has no {NOISE_KEY!r}: generate the batch with a uniforms table "
            "(engine.generate(prompts, sampling, uniforms=uniform_table(rows, steps, seed)))"
        )
    n_rows = batch.response_ids.shape[0]
    check_uniforms(noise, (n_rows, -1), name=f"batch.extras[{NOISE_KEY!r}]")
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.dtype != torch.long or rows.numel() == 0:
        raise ValueError(f"rows must be a non-empty [P, n] long tensor, got {_describe(rows)}")
    if bool(((rows < 0) | (rows >= n_rows)).any()):
        raise ValueError(f"rows must index the batch's {n_rows} rows, got values outside [0, {n_rows})")
    owner = batch.prompt_index[rows]  # [P, n]
    if bool((owner != owner[:, :1]).any()):
        raise ValueError(
            "rows must hold rows of one prompt per line (batch.prompt_index differs within a line)"
        )
    if not supports_coupled_noise(engine):
        raise ValueError(f"engine {type(engine).__name__} takes no uniforms table in generate()")
    first = rows[:, 0]  # [P]
    prompts = [ids[mask].tolist() for ids, mask in zip(batch.prompt_ids[first], batch.prompt_mask[first])]
    flat = rows.reshape(-1)  # [P * n]
    again = dataclasses.replace(sampling, n=rows.shape[1], seed=None)
    out = engine.generate(prompts, again, uniforms=noise[flat])
    return dataclasses.replace(out, prompt_index=batch.prompt_index[flat].clone())


def coupling_agreement(logprobs_a: torch.Tensor, logprobs_b: torch.Tensor) -> torch.Tensor:
    """P(same token) when one uniform u drives inverse-CDF sampling from a and from b.  # [B]

    ``logprobs_a``, ``logprobs_b``: ``[B, V]`` log-probabilities over the same vocabulary order
    (``-inf`` allowed; each row is normalized here). Token v is drawn from a when u lies in
    ``[F_a(v-1), F_a(v))``, so both pick v for the u in the overlap of the two intervals:

        agreement = sum_v max(0, min(F_a(v), F_b(v)) - max(F_a(v-1), F_b(v-1)))

    It is 1 exactly when the distributions are equal, and at most 1 - TV(a, b) (no coupling agrees
    more often). Inverse-CDF coupling reaches that bound only when mass moves between neighbouring
    tokens: a difference early in the vocabulary order shifts every later interval boundary, so flat
    distributions couple worse than peaked ones.
    """
    for name, x in (("logprobs_a", logprobs_a), ("logprobs_b", logprobs_b)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating [B, V] tensor, got {_describe(x)}")
    if logprobs_a.shape != logprobs_b.shape:
        raise ValueError(
            f"logprobs_a has shape {tuple(logprobs_a.shape)} but logprobs_b has shape "
            f"{tuple(logprobs_b.shape)}"
        )

    def cdf(lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = lp.double().softmax(-1)  # [B, V]
        hi = p.cumsum(-1)  # [B, V]
        return hi - p, hi

    lo_a, hi_a = cdf(logprobs_a)
    lo_b, hi_b = cdf(logprobs_b)
    overlap = (torch.minimum(hi_a, hi_b) - torch.maximum(lo_a, lo_b)).clamp(min=0)  # [B, V]
    return overlap.sum(-1).clamp(max=1.0).float()


def token_agreement(
    ids_a: torch.Tensor, mask_a: torch.Tensor, ids_b: torch.Tensor, mask_b: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How two generations of the same rows with the same noise agree, per row.

    ``ids_*``: ``[B, T_*]`` long, ``mask_*``: ``[B, T_*]`` bool (True on generated tokens); the two may
    have different widths. Returns ``[B]`` tensors:

    - ``shared``: the common prefix length (tokens both generated identically before any difference);
    - ``identical``: both responses are the same token sequence;
    - ``steps``: the steps at which both engines sampled from the same context: ``shared + 1`` for a
      row that diverged (the divergence step counts), the response length for an identical one;
    - ``diverged``: the row diverged (``~identical``).

    ``1 - diverged.sum() / steps.sum()`` is the per-step agreement rate, an estimate of the mean
    :func:`coupling_agreement` over the contexts visited.
    """
    for name, ids, mask in (("a", ids_a, mask_a), ("b", ids_b, mask_b)):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
            raise ValueError(f"ids_{name} must be a [B, T] long tensor, got {_describe(ids)}")
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != ids.shape:
            raise ValueError(
                f"mask_{name} must be a bool tensor shaped like ids_{name}, got {_describe(mask)}"
            )
    if ids_a.shape[0] != ids_b.shape[0]:
        raise ValueError(f"ids_a has {ids_a.shape[0]} rows but ids_b has {ids_b.shape[0]}")
    width = max(ids_a.shape[1], ids_b.shape[1])

    def widen(x: torch.Tensor, fill: Any) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill)

    a, ma = widen(ids_a, -1), widen(mask_a, False)  # [B, W]
    b, mb = widen(ids_b, -1), widen(mask_b, False)  # [B, W]
    same = (a == b) & ma & mb  # [B, W]
    shared = same.long().cumprod(-1).sum(-1)  # [B]
    len_a, len_b = ma.sum(-1), mb.sum(-1)  # [B]
    identical = (shared == len_a) & (shared == len_b)
    steps = torch.where(identical, len_b, shared + 1)
    return {"shared": shared, "identical": identical, "steps": steps, "diverged": ~identical}


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
