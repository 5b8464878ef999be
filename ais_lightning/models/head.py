"""The output head of a Hugging Face causal LM, as the model's own ``forward`` applies it.

Most causal LMs compute ``logits = lm_head(h)`` from the decoder's last hidden state ``h``. Some
families transform those logits before returning them, and code that calls ``lm_head`` itself (the
policy's chunked log-probs, the torch engine's lean forward) must do the same or score every token
under the wrong distribution:

- Granite (``config.logits_scaling``): ``logits / logits_scaling``;
- Cohere (``config.logit_scale``): ``logits * logit_scale``;
- Gemma 2 / Gemma 3 (``config.final_logit_softcapping``): ``cap * tanh(logits / cap)``.

:func:`logit_transform` reads these from a config; :func:`head_mismatch` measures whether
``transform(lm_head(decoder(x)))`` reproduces ``model(x).logits`` on a short probe, so that a family
whose head does something else is caught where the head is built, not in the training curves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["LogitTransform", "decoder_body", "decoder_hidden_states", "head_mismatch", "logit_transform"]


@dataclass(frozen=True)
class LogitTransform:
    """``logits -> softcap(logits * multiply / divide)``; the identity by default.

    Each field is applied exactly as the model's forward applies it (a division stays a division), so
    the result equals the model's logits bit for bit.

    Args:
        multiply: Cohere's ``logit_scale``.
        divide: Granite's ``logits_scaling``.
        softcap: Gemma 2/3's ``final_logit_softcapping``: ``cap * tanh(logits / cap)``, or None.
    """

    multiply: float = 1.0
    divide: float = 1.0
    softcap: float | None = None

    @property
    def is_identity(self) -> bool:
        return self.multiply == 1.0 and self.divide == 1.0 and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V]
        if self.multiply != 1.0:
            logits = logits * self.multiply
        if self.divide != 1.0:
            logits = logits / self.divide
        if self.softcap is not None:  # Gemma 2's order of operations: divide, tanh, multiply
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _positive(config: Any, key: str) -> float | None:
    value = getattr(config, key, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"config.{key} must be a positive number or None, got {value!r}")
    return float(value)


def logit_transform(config: Any) -> LogitTransform:
    """The logit transform a Hugging Face causal LM with ``config`` applies after ``lm_head``."""
    return LogitTransform(
        multiply=_positive(config, "logit_scale") or 1.0,  # Cohere: logits * logit_scale
        divide=_positive(config, "logits_scaling") or 1.0,  # Granite: logits / logits_scaling
        softcap=_positive(config, "final_logit_softcapping"),  # Gemma 2 / 3
    )


def decoder_body(model: nn.Module) -> nn.Module:
    """The decoder body of a causal LM (what produces the last hidden state ``lm_head`` reads)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        decoder = getattr(model, "model", None)
    if decoder is None:
        raise ValueError(f"cannot find the decoder body of {type(model).__name__}")
    return decoder


def decoder_hidden_states(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """The decoder body's last hidden states ``[B, L, H]`` (no cache): what ``lm_head`` reads."""
    out = decoder_body(model)(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    return out[0] if isinstance(out, tuple) else out.last_hidden_state


@torch.no_grad()
def head_mismatch(model: nn.Module, transform: LogitTransform, length: int = 4) -> float | None:
    """Largest relative difference between ``model(x).logits`` and ``transform(lm_head(decoder(x)))``.

    Runs both on one probe sequence of ``length`` token ids (``1..length``, in eval mode, so dropout
    cannot differ) and returns ``max |a - b| / max(1, max |a|)``: about 1e-7 in fp32 when the head is
    reproduced, of the order of the logits' own size when it is not. Returns None when the model cannot
    be run here (parameters on the meta device or sharded across processes).
    """
    params = list(model.parameters())
    if not params or any(p.is_meta or type(p).__name__ == "DTensor" for p in params):
        return None
    vocab = model.get_output_embeddings().weight.shape[0]
    device = params[0].device
    ids = (torch.arange(1, length + 1, device=device) % vocab)[None]  # [1, L]
    mask = torch.ones_like(ids)
    positions = torch.arange(length, device=device)[None]
    was_training = model.training
    model.eval()
    try:
        reference = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        hidden = decoder_hidden_states(model, ids, mask, positions)  # [1, L, H]
    finally:
        model.train(was_training)
    ours = transform(model.get_output_embeddings()(hidden)).float()  # [1, L, V]
    theirs = reference.logits.float()  # [1, L, V]
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1.0))
