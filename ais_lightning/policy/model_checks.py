"""Checks of the model a policy wraps, at construction: what :class:`ais_lightning.policy.Policy` relies on.

The policy scores responses with the decoder body and a chunked ``lm_head`` (:mod:`ais_lightning.policy.scoring`),
never through ``model.forward``: the model must have an output embedding, its forward must do nothing to the
logits beyond a known transform, and routing replay needs routers whose gate weights it can recompute.
"""

from __future__ import annotations

import torch
from torch import nn

from ais_lightning.models.head import LogitTransform, head_mismatch, logit_transform
from ais_lightning.models.routing import gate_normalization, moe_routers

__all__ = [
    "HEAD_TOLERANCE",
    "check_causal_lm",
    "check_chunk_size",
    "check_float32_head",
    "check_router_replay",
    "checked_logit_transform",
]

HEAD_TOLERANCE: dict[torch.dtype | None, float] = {torch.float32: 1e-4, torch.float64: 1e-4, None: 2e-2}
"""Largest relative difference between the policy's head and the model's forward accepted at construction,
by parameter dtype (None: any other): about 1e-7 in fp32 when the head is reproduced, 0.1 to 1 when a
logit transform is missing."""


def check_causal_lm(model: nn.Module) -> None:
    """Raise ValueError unless ``model`` is a causal LM with an output embedding (its ``lm_head``)."""
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise ValueError(
            f"model must be a Hugging Face causal LM with an output embedding, got {type(model)}"
        )


def check_chunk_size(logprob_chunk_size: int) -> None:
    """Raise ValueError unless ``logprob_chunk_size`` is an int >= 1."""
    if (
        isinstance(logprob_chunk_size, bool)
        or not isinstance(logprob_chunk_size, int)
        or logprob_chunk_size < 1
    ):
        raise ValueError(f"logprob_chunk_size must be an int >= 1, got {logprob_chunk_size!r}")


def check_float32_head(model: nn.Module) -> None:
    """Raise ValueError unless ``model``'s output layer has a weight (``head_dtype='float32'`` projects with it)."""
    if not isinstance(getattr(model.get_output_embeddings(), "weight", None), torch.Tensor):
        raise ValueError(
            f"head_dtype='float32' needs a linear output layer with a weight, got "
            f"{type(model.get_output_embeddings()).__name__}"
        )


def checked_logit_transform(model: nn.Module) -> LogitTransform:
    """The model's logit transform, checked on a short probe against the model's own forward.

    The policy computes logits as ``transform(lm_head(decoder(x)))`` in chunks, never through
    ``model.forward``; a family whose forward does something else to its logits would be scored under
    the wrong distribution, so it is refused here. Skipped for a model on the meta device or sharded.
    """
    transform = logit_transform(model.config)
    mismatch = head_mismatch(model, transform)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    tolerance = HEAD_TOLERANCE.get(dtype, HEAD_TOLERANCE[None])
    if mismatch is not None and not mismatch <= tolerance:
        raise ValueError(
            f"{type(model).__name__}'s forward computes its logits differently from lm_head(decoder(x)) "
            f"followed by {transform} (relative difference {mismatch:.3g} > {tolerance:g} on a 4-token probe), "
            "so Policy would score responses under the wrong distribution. The logit transforms it knows are "
            "in ais_lightning.models.head.logit_transform (Granite's logits_scaling, Cohere's logit_scale, "
            "Gemma 2/3's final_logit_softcapping)"
        )
    return transform


def check_router_replay(model: nn.Module, router_replay: bool) -> bool:
    """``router_replay`` checked against the model (ValueError naming ``router_replay`` otherwise): a
    mixture-of-experts model whose routers' gate weights :func:`replay_gate_weights` reproduces."""
    if not isinstance(router_replay, bool):
        raise ValueError(f"router_replay must be true or false, got {router_replay!r}")
    if not router_replay:
        return False
    routers = moe_routers(model)
    if not routers:
        raise ValueError(
            f"router_replay=true replays a mixture-of-experts model's routing, but {type(model).__name__} has "
            "no top-k routers"
        )
    for router in routers:
        if gate_normalization(router) is None:
            raise ValueError(
                f"router_replay=true: {type(router).__name__}'s gate weights are not softmax(logits) at its top-k "
                "(renormalized or not), which replay recomputes; this router (sigmoid or grouped routing) is not "
                "supported"
            )
    return True
