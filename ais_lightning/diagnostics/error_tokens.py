"""``ErrorTokenRate``: how much of the rollout is degenerate "error tokens".

QaRL (Gu et al. 2026, arXiv 2604.07853) names a failure mode of quantized rollouts: long responses
degenerate into repetitive or garbled tokens ("error tokens"). The paper's detector is not at hand;
this module measures two proxies, as implemented here:

* ``kind="repeat"`` (repetition): the fraction of valid response tokens that lie inside a
  back-to-back repetition, see :func:`repeat_token_mask`.
* ``kind="low_logprob"`` (garbling): the fraction of valid response tokens whose log-prob under the
  high-precision TRAINER is below ``logprob_threshold`` (default -8: probability < 3.4e-4), i.e.
  tokens the trainer itself would almost never emit, sampled because the quantized rollout's
  distribution drifted.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from ais_lightning.diagnostics.base import MaskedMeanMetric
from ais_lightning.ops import check_mask, check_token_tensor

ERROR_TOKEN_KINDS = ("repeat", "low_logprob")


def _check_positive_int(value: int, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def repeat_token_mask(
    response_ids: torch.Tensor, mask: torch.Tensor, ngram: int = 3, min_repeats: int = 3, min_ngram: int = 1
) -> torch.Tensor:
    """Valid tokens that lie inside a back-to-back repetition of an n-gram.  # [B, T] bool

    Definition: for a unit length n in ``min_ngram .. ngram``, a window of W = n * ``min_repeats``
    consecutive positions s .. s+W-1, all valid, is a repetition when it consists of ``min_repeats``
    copies of one n-gram, i.e. ``ids[u] == ids[u + n]`` for every u in s .. s+W-n-1. A token is
    flagged when some such window (for some n) contains it. Consequently a maximal n-periodic span of
    L >= W valid tokens is flagged entirely, including a trailing partial copy ("abcabcabcab" with
    n=3, k=3: all 11 tokens), and a span shorter than W is not flagged at all.

    Shorter units are checked too because a repetition with period 2 has no period 3 ("ababab...");
    with a character-level tokenizer, ``min_ngram=1`` also flags runs like "000" (``min_repeats=3``),
    so raise ``min_ngram`` or ``min_repeats`` there if numbers with repeated digits are expected.

    Vectorised: per unit length, one comparison, a cumulative sum to find windows of all-equal
    comparisons, and a max-pool to spread each window onto its tokens, O(ngram * B * T) in total.
    Masked positions never match, so padding neither counts nor bridges two repetitions.
    """
    check_mask(mask)
    if not isinstance(response_ids, torch.Tensor):
        raise ValueError(f"response_ids must be a torch.Tensor, got {type(response_ids).__name__}")
    if (
        response_ids.dtype.is_floating_point
        or response_ids.dtype.is_complex
        or response_ids.dtype == torch.bool
    ):
        raise ValueError(f"response_ids must be an integer (token id) tensor, got dtype {response_ids.dtype}")
    if response_ids.shape != mask.shape:
        raise ValueError(
            f"response_ids has shape {tuple(response_ids.shape)} but mask has shape {tuple(mask.shape)}"
        )
    _check_positive_int(min_ngram, "min_ngram", 1)
    _check_positive_int(ngram, "ngram", min_ngram)
    _check_positive_int(min_repeats, "min_repeats", 2)

    B, T = mask.shape
    flagged = torch.zeros_like(mask)  # [B, T]
    for n in range(min_ngram, ngram + 1):
        window = n * min_repeats  # W tokens = min_repeats copies of an n-gram
        if window > T:
            break
        same = (response_ids[:, n:] == response_ids[:, :-n]) & mask[:, n:] & mask[:, :-n]  # [B, T-n]
        need = window - n  # comparisons inside one window, > 0 since min_repeats >= 2
        csum = F.pad(same.long().cumsum(dim=-1), (1, 0))  # [B, T-n+1], csum[j] = sum(same[:j])
        starts = (csum[:, need:] - csum[:, :-need]) == need  # [B, T-W+1], window s..s+W-1 repeats
        # token t is covered if a window starts in t-W+1 .. t: max over a sliding width-W window
        padded = F.pad(starts.to(torch.float32), (window - 1, window - 1))  # [B, T+W-1]
        covered = F.max_pool1d(padded.unsqueeze(1), kernel_size=window, stride=1).squeeze(1) > 0  # [B, T]
        flagged |= covered
    return flagged & mask


class ErrorTokenRate(MaskedMeanMetric):
    """Fraction of valid response tokens that are "error tokens" (QaRL, arXiv 2604.07853).

    The two kinds take DIFFERENT ``update`` arguments (first positional argument):

    * ``ErrorTokenRate("repeat", ngram=3, min_repeats=3)``: ``update(response_ids, mask)`` with
      ``response_ids`` ``[B, T]`` integer token ids; a token counts when :func:`repeat_token_mask`
      flags it (inside ``min_repeats`` back-to-back copies of an n-gram, n in ``min_ngram .. ngram``).
    * ``ErrorTokenRate("low_logprob", logprob_threshold=-8.0)``: ``update(train_logprobs, mask)``
      with ``train_logprobs`` ``[B, T]`` float log-probs of the sampled tokens under the trainer
      (not the rollout engine); a token counts when its log-prob is strictly below the threshold.

    ``mask`` is ``[B, T]`` bool (True = valid response token). One scalar over every valid token seen;
    states ``total`` / ``count`` are sum-reduced, so a DDP/FSDP sync is exact; 0.0 before any valid
    token was seen. Repetition is judged within one ``update`` row: pass whole responses.
    """

    higher_is_better = False

    def __init__(
        self,
        kind: str = "repeat",
        ngram: int = 3,
        min_repeats: int = 3,
        logprob_threshold: float = -8.0,
        min_ngram: int = 1,
        **kwargs: Any,
    ) -> None:
        if kind not in ERROR_TOKEN_KINDS:
            raise ValueError(f"kind must be one of {ERROR_TOKEN_KINDS}, got {kind!r}")
        _check_positive_int(min_ngram, "min_ngram", 1)
        _check_positive_int(ngram, "ngram", min_ngram)
        _check_positive_int(min_repeats, "min_repeats", 2)
        if not (isinstance(logprob_threshold, (int, float)) and math.isfinite(logprob_threshold)):
            raise ValueError(f"logprob_threshold must be a finite number, got {logprob_threshold!r}")
        if logprob_threshold > 0:
            raise ValueError(f"logprob_threshold must be <= 0 (log-probs are <= 0), got {logprob_threshold}")
        super().__init__(**kwargs)
        self.kind = kind
        self.ngram = ngram
        self.min_repeats = min_repeats
        self.min_ngram = min_ngram
        self.logprob_threshold = float(logprob_threshold)

    def update(self, values: torch.Tensor, mask: torch.Tensor) -> None:
        """``values`` is ``response_ids`` (kind ``repeat``) or ``train_logprobs`` (kind ``low_logprob``)."""
        if self.kind == "repeat":
            errors = repeat_token_mask(values, mask, self.ngram, self.min_repeats, self.min_ngram)  # [B, T]
        else:
            check_mask(mask)
            check_token_tensor(values, "train_logprobs", mask)
            errors = values.detach() < self.logprob_threshold  # [B, T]
        self._accumulate(errors, mask)
