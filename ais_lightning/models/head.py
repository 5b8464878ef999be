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

The precision of the head's projection is a separate choice (``policy.head_dtype``, ``rollout.head_dtype``:
:data:`HEAD_DTYPES`): by default it computes in the model's dtype, as the model's own forward does;
``"float32"`` computes ``hidden @ W.T`` in fp32 from the (low-precision) hidden states and weights, whose
values are unchanged (:func:`head_logits`; :class:`Float32Head` for an engine's private copy). That is the
"fp32 LM head" of TRL's ``cast_lm_head_to_fp32``, prime-rl's ``enable_fp32_lm_head`` and NeMo-RL's
``fp32_lm_head``: at bf16 or fp16 the logits are no longer rounded to the model dtype's grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "HEAD_DTYPES",
    "Float32Head",
    "LogitTransform",
    "check_head_dtype",
    "decoder_body",
    "decoder_hidden_states",
    "head_logits",
    "head_mismatch",
    "logit_transform",
]

HEAD_DTYPES = (None, "auto", "model", "float32")
"""Precisions of the LM head's projection: None / ``"auto"`` / ``"model"`` = the model's dtype (what the model's
own forward does: the behaviour before the option existed), ``"float32"`` = fp32 logits from the model-dtype hidden
states and weights (vLLM's ``head_dtype`` names, ``"model"`` and ``"float32"``)."""


def check_head_dtype(value: Any, key: str = "head_dtype") -> bool:
    """Whether ``value`` (one of :data:`HEAD_DTYPES`) asks for an fp32 head; ValueError naming ``key`` otherwise."""
    if value not in HEAD_DTYPES:
        raise ValueError(f"{key} must be one of {list(HEAD_DTYPES)}, got {value!r}")
    return value == "float32"


def head_logits(head: nn.Module, hidden: torch.Tensor, float32: bool = False) -> torch.Tensor:
    """``head(hidden)``, or with ``float32`` the same projection computed in fp32.  # [..., H] -> [..., V]

    The fp32 projection upcasts the operands (``F.linear(hidden.float(), W.float(), b.float())``): the
    products of bf16/fp16 values are exact in fp32, so this is the model-dtype matmul without the rounding of
    its output (and of its partial sums) to the model dtype. Gradients reach ``W`` in its own dtype through the
    cast. An fp32 head on fp32 tensors is the plain call.
    """
    weight = getattr(head, "weight", None)
    if not float32 or (
        hidden.dtype == torch.float32 and weight is not None and weight.dtype == torch.float32
    ):
        return head(hidden)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"an fp32 head needs a linear output layer with a weight, got {type(head).__name__}")
    bias = getattr(head, "bias", None)
    return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


class Float32Head:
    """Makes an engine's output layer compute in fp32 (``rollout.head_dtype=float32``), weights unchanged.

    Installed as the layer's ``forward`` on a private copy of a model (an engine's): the lean forward and the
    model's own forward both call the layer, so both get fp32 logits. The fp32 copy of the weight is kept between
    calls (one cast per weight sync, not per decode step): call :meth:`refresh` after the weights change. The
    layer's parameters, names and dtype are untouched, so weight syncs and state dicts are as before.
    """

    def __init__(self, head: nn.Module) -> None:
        if not isinstance(getattr(head, "weight", None), torch.Tensor):
            raise ValueError(
                f"an fp32 head needs a linear output layer with a weight, got {type(head).__name__}"
            )
        self.head = head
        self.weight = self.bias = None
        self.refresh()
        head.forward = self  # the instance attribute shadows the class's forward

    def refresh(self) -> None:
        """Re-take the fp32 copy of the weight (and bias) from the layer."""
        with torch.no_grad():
            self.weight = self.head.weight.detach().float()
            bias = getattr(self.head, "bias", None)
            self.bias = None if bias is None else bias.detach().float()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] fp32
        return F.linear(hidden.float(), self.weight, self.bias)


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
