"""The kept support of truncated sampling: which tokens min-p / top-k / top-p left at each sampled position.

A truncated sampler draws from mu_S(a) = mu(a) / mu(S) over the set S its own logits kept, 0 outside. A trainer
that scores pi over the whole vocabulary compares pi(a) with mu_S(a): the ratio pi / mu_S = (pi / mu) * mu(S)
carries the kept mass mu(S) < 1, a bias that every corrector then "corrects" (TRL issue 6789, ms-swift 8442).
Filtering on the trainer's side with its own logits (NeMo-RL's ``apply_top_k_top_p``) keeps the set the
*trainer* ranks highest, which differs from the engine's wherever the two forwards order the tokens near the cut
differently, and can drop the very token that was sampled (its log pi is then -inf). Replay: the engine records S
and the trainer renormalizes pi over exactly S, pi_S(a) = pi(a) / pi(S). Then pi_S and mu_S are distributions
over one support, pi_S / mu_S is the exact importance ratio (1 to float precision when the two forwards compute
the same logits), and the PPO ratio, the corrector's weights, k3 against the reference and the entropy all
describe the truncated policy that actually samples. S is a step function of the engine's logits, so for the
recorded S the gradient of log pi_S is the exact policy gradient of the truncated sampler.

Layout (:class:`SamplingSupport`, ``RolloutBatch.support``), rows first so that ``RolloutBatch.rows`` and
``ops.to_device`` take and move it like every other field:

- ``counts`` ``[B, T]`` int32: |S| at each response position, 0 where the response mask is False;
- ``ids`` ``[B, L]`` int32: each row's kept token ids, position after position (ascending ids within a
  position), then -1; ``L`` is the longest row's total.

Memory: ``4 * B * (T + L)`` bytes. With ``top_k=k``, ``L <= k * T``: at most ``4 * (k + 1)`` bytes per position
(84 at k = 20). With top-p or min-p alone ``L`` is the longest row's summed nucleus, up to ``V`` per position for
flat distributions (a dense ``[B, T, V]`` bool mask costs ``V`` bytes per position whatever the nucleus; a
measured ``L`` is in docs/correctors.md). The trainer expands one chunk of positions at a time into a
``[chunk, V]`` bool mask (:func:`kept_mask`), a quarter of that chunk's fp32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ais_lightning.ops import autograd_usable

__all__ = [
    "MASKED_LOGIT",
    "FlatSupport",
    "SamplingSupport",
    "SupportRecorder",
    "kept_mask",
    "replayed_log_softmax",
]

MASKED_LOGIT = -1e30
"""What :func:`replayed_log_softmax` writes over the tempered logits of dropped tokens: finite, so that entropy and
impurity (``p * log p``) and their gradients stay 0 there instead of NaN, and so far below any real logit that
``exp`` underflows to exactly 0: the result equals the engine's ``log_softmax`` with ``-inf`` on every kept token."""


class FlatSupport(NamedTuple):
    """The kept sets of N positions in one order (the valid response positions, row-major, by default)."""

    ids: torch.Tensor
    """``[K]`` long, the positions' kept token ids, one position after the other."""
    counts: torch.Tensor
    """``[N]`` long, each position's set size (``counts.sum() == K``)."""

    def take(self, index: torch.Tensor) -> FlatSupport:
        """The positions ``index`` (``[M]`` long), in that order."""
        starts = self.counts.cumsum(0) - self.counts  # [N] where each position's ids start
        counts = self.counts[index]  # [M]
        first = torch.repeat_interleave(starts[index], counts)  # [K'] the start of each taken id's segment
        within = torch.arange(int(counts.sum()), device=counts.device) - torch.repeat_interleave(
            counts.cumsum(0) - counts, counts
        )  # [K'] the offset inside it
        return FlatSupport(self.ids[first + within], counts)

    def split(self, size: int) -> list[FlatSupport]:
        """Consecutive pieces of ``size`` positions (the last may be shorter), as ``Tensor.split``."""
        counts = self.counts.split(size)
        ids = self.ids.split([int(c.sum()) for c in counts])
        return [FlatSupport(i, c) for i, c in zip(ids, counts)]


@dataclass
class SamplingSupport:
    """The tokens a truncated sampler kept at each response position of a batch (module docstring)."""

    counts: torch.Tensor
    """``[B, T]`` int32, the kept set's size at each position; 0 where the response mask is False."""
    ids: torch.Tensor
    """``[B, L]`` int32, each row's kept ids, position after position, then -1."""

    @property
    def num_bytes(self) -> int:
        """The memory it holds."""
        return self.counts.numel() * self.counts.element_size() + self.ids.numel() * self.ids.element_size()

    @staticmethod
    def cat(parts: list[SamplingSupport], width: int) -> SamplingSupport:
        """The rows of ``parts`` one after the other, as one support of ``width`` response positions (each part's
        own positions first, the rest with no kept token), ids padded with -1 to the longest row."""
        rows = sum(p.counts.shape[0] for p in parts)
        longest = max((p.ids.shape[1] for p in parts), default=0)
        dev = parts[0].counts.device if parts else None
        counts = torch.zeros((rows, width), dtype=torch.int32, device=dev)  # [B, T]
        ids = torch.full((rows, longest), -1, dtype=torch.int32, device=dev)  # [B, L]
        row = 0
        for p in parts:
            n = p.counts.shape[0]
            counts[row : row + n, : p.counts.shape[1]] = p.counts
            ids[row : row + n, : p.ids.shape[1]] = p.ids
            row += n
        return SamplingSupport(counts, ids)

    def flat(self, mask: torch.Tensor) -> FlatSupport:
        """The kept sets of the positions ``mask`` (``[B, T]`` bool, the batch's response mask), row-major (the order
        of ``x[mask]``), as tensors autograd may save; ValueError naming the tensor when the support does not fit the
        mask."""
        counts, ids = self.counts, self.ids
        if not isinstance(counts, torch.Tensor) or counts.shape != mask.shape or counts.is_floating_point():
            raise ValueError(
                f"support.counts must be an integer tensor of the response shape {tuple(mask.shape)}, got "
                f"{getattr(counts, 'dtype', type(counts).__name__)} {tuple(getattr(counts, 'shape', ()))}"
            )
        if (
            not isinstance(ids, torch.Tensor)
            or ids.dim() != 2
            or ids.shape[0] != mask.shape[0]
            or ids.is_floating_point()
        ):
            raise ValueError(
                f"support.ids must be an integer [B={mask.shape[0]}, L] tensor, got {tuple(ids.shape)}"
            )
        if bool((counts[~mask] != 0).any()) or bool((counts[mask] < 1).any()):
            raise ValueError(
                "support.counts must be >= 1 on every valid response position and 0 elsewhere (a support recorded "
                "for another response mask?)"
            )
        present = ids >= 0  # [B, L]
        if bool((present[:, 1:] & ~present[:, :-1]).any()) or not torch.equal(
            present.sum(-1), counts.sum(-1).to(present.device)
        ):
            raise ValueError(
                "support.ids must hold, per row, exactly support.counts' total of ids >= 0, then -1"
            )
        # normal tensors even from an engine's inference-mode batch: a checkpointed head saves its inputs
        return FlatSupport(autograd_usable(ids[present].long()), autograd_usable(counts[mask].long()))


def kept_mask(support: FlatSupport, vocab_size: int) -> torch.Tensor:
    """The kept sets as a dense mask over the vocabulary.  # [N, V] bool"""
    ids, counts = support
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
        raise ValueError(f"support has token ids outside the vocabulary [0, {vocab_size})")
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)  # [K]
    mask = torch.zeros((counts.numel(), vocab_size), dtype=torch.bool, device=ids.device)
    mask[rows.to(ids.device), ids] = True
    return mask


def replayed_log_softmax(logits: torch.Tensor, keep: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` renormalized over the kept tokens, in fp32.  # [N, V]

    ``logits`` ``[N, V]``, ``keep`` ``[N, V]`` bool. Kept tokens get log pi_S = log pi - log pi(S), the others
    :data:`MASKED_LOGIT` - logsumexp (probability exactly 0, finite, gradient 0).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    scaled = logits.float() / temperature  # [N, V]
    return torch.log_softmax(scaled.masked_fill(~keep, MASKED_LOGIT), dim=-1)


class SupportRecorder:
    """Collects the kept sets an engine samples with, position by position, into a :class:`SamplingSupport`.

    ``add(rows, cols, kept)`` after each draw (any order; each position once), then ``build(response_mask)``.
    """

    def __init__(self) -> None:
        self._rows: list[torch.Tensor] = []
        self._cols: list[torch.Tensor] = []
        self._counts: list[torch.Tensor] = []
        self._ids: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor, cols: torch.Tensor | int, kept: torch.Tensor) -> None:
        """Positions ``(rows[i], cols[i])`` (``[n]`` long; ``cols`` may be one int) were drawn from the kept sets
        ``kept`` (``[n, V]`` bool)."""
        if isinstance(cols, int):
            cols = torch.full_like(rows, cols)
        self._rows.append(rows.to(torch.int64))
        self._cols.append(cols.to(torch.int64))
        self._counts.append(kept.sum(-1))
        self._ids.append(kept.nonzero()[:, 1].to(torch.int32))  # row-major: each position's ids ascending

    def build(self, response_mask: torch.Tensor) -> SamplingSupport:
        """The recorded sets of the positions where ``response_mask`` (``[B, T]`` bool) is True."""
        b, t = response_mask.shape
        dev = response_mask.device
        if not self._rows:
            return SamplingSupport(
                torch.zeros((b, t), dtype=torch.int32, device=dev),
                torch.zeros((b, 0), dtype=torch.int32, device=dev),
            )
        rows, cols = torch.cat(self._rows).to(dev), torch.cat(self._cols).to(dev)  # [E]
        flat = FlatSupport(torch.cat(self._ids).to(dev), torch.cat(self._counts).to(dev))
        valid = torch.zeros_like(rows, dtype=torch.bool)  # [E] recorded positions on a valid response token
        inside = cols < t
        valid[inside] = response_mask[rows[inside], cols[inside]]
        key = rows * t + cols  # [E]
        taken = valid.nonzero().squeeze(-1)  # [E'] the positions that stay
        taken = taken[torch.argsort(key[taken], stable=True)]  # row-major
        if bool((key[taken][1:] == key[taken][:-1]).any()):
            raise RuntimeError("SupportRecorder: a position was recorded twice")
        flat = flat.take(taken)
        counts = torch.zeros((b, t), dtype=torch.int32, device=dev)  # [B, T]
        counts[rows[taken], cols[taken]] = flat.counts.to(torch.int32)
        per_row = counts.sum(-1).long()  # [B]
        ids = torch.full((b, int(per_row.max())), -1, dtype=torch.int32, device=dev)  # [B, L]
        owner = torch.repeat_interleave(torch.arange(b, device=dev), per_row)  # [K] the row of each id
        offset = torch.arange(owner.numel(), device=dev) - (per_row.cumsum(0) - per_row)[owner]  # [K]
        ids[owner, offset] = flat.ids.to(torch.int32)
        return SamplingSupport(counts, ids)
