"""Policy: a thin ``nn.Module`` around a Hugging Face causal LM for RL training.

It computes the log-prob (and optionally the entropy) of each response token under the
temperature-processed policy, without ever materializing the full ``[B, T, V]`` logits, and exports
the full (unsharded) weights and buffers for rollout-engine weight sync.

Sequence layout (shared with every rollout engine): the prompt is left-padded, the response
right-padded, the two are concatenated, and positions count real tokens only
(``position_ids = cumsum(attention_mask) - 1``), so a padded row reproduces the unpadded row.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ais_lightning.models.head import (
    LogitTransform,
    check_head_dtype,
    decoder_body,
    decoder_hidden_states,
    head_logits,
    head_mismatch,
    logit_transform,
)
from ais_lightning.models.prompting import check_chat_template, encode_prompts
from ais_lightning.models.routing import RoutingReplay, gate_normalization, moe_routers, routing_replay_mask
from ais_lightning.models.training import disable_dropout_in, enable_activation_checkpointing
from ais_lightning.ops import (
    autograd_usable,
    entropy_from_logprobs,
    impurity_from_logprobs,
    logprobs_from_logits,
    masked_mean,
    tempered_log_softmax,
)

if TYPE_CHECKING:
    from ais_lightning.rollout.base import RolloutBatch

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")
"""Name fragments that activation-checkpoint / FSDP1 / torch.compile wrappers add to buffer names."""
_LAYER_LIST_NAMES = ("layers", "h", "blocks")
"""Attribute names under which Hugging Face decoder bodies keep their ``nn.ModuleList`` of blocks."""
HEAD_TOLERANCE: dict[torch.dtype | None, float] = {torch.float32: 1e-4, torch.float64: 1e-4, None: 2e-2}
"""Largest relative difference between the policy's head and the model's forward accepted at construction,
by parameter dtype (None: any other): about 1e-7 in fp32 when the head is reproduced, 0.1 to 1 when a
logit transform is missing."""
_FSDP_FORWARD_METHOD = "_ais_policy_response_logprobs"
"""Attribute under which the log-prob computation is registered as an FSDP2 forward method of the model."""


@dataclass
class ResponseLogprobs:
    """Per-token outputs of :meth:`Policy.response_logprobs`."""

    logprobs: torch.Tensor
    """``[B, T]`` float32 log-prob of each response token under ``softmax(logits / temperature)``; 0 where masked."""
    entropy: torch.Tensor | None
    """``[B, T]`` float32 entropy (nats) of the temperature-processed next-token distribution; 0 where masked.
    None unless ``compute_entropy=True``."""
    impurity: torch.Tensor | None = None
    """``[B, T]`` float32 collision impurity ``1 - sum_a pi(a)^2`` of the same distribution
    (``ops.impurity_from_logprobs``); 0 where masked. None unless ``compute_entropy=True``. Values only (no
    gradient): correctors and metrics read it."""


LogprobTensors = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]
"""``(logprobs, entropy, impurity)`` ``[B, T]`` each, as a policy's forward returns them (FSDP and DDP hooks
see plain tensors): :class:`ResponseLogprobs`'s fields in order."""


def check_aligned_quantization(recipe: str) -> None:
    """Raise ValueError unless ``recipe`` names an ``ais_lightning.quant`` quantization recipe."""
    from ais_lightning.quant.recipes import RECIPES

    if recipe not in RECIPES:
        raise ValueError(
            f"aligned_quantization={recipe!r} is not a quantization recipe (QaRL's aligned forward needs a "
            f"quantized rollout precision); known recipes: {sorted(RECIPES)}"
        )


def check_aligned_schedule(
    stages: Any, aligned_quantization: str | None = None
) -> tuple[tuple[int, str], ...]:
    """Validate a progressive aligned-quantization schedule; returns it as ``((start, recipe), ...)``.

    ``stages``: ``[[0, "int8_nested"], [N1, "int4"], [N2, "int2"]]`` (pairs as lists or tuples; Hydra's
    ``ListConfig`` works): recipe ``r`` runs from rollout step ``start`` to the next stage's start; starts
    are ints strictly increasing from 0; every recipe names an ``ais_lightning.quant`` recipe.
    ``aligned_quantization``, when given, must be the first stage's recipe (the forward before any step).
    """
    from ais_lightning.quant import RECIPES, PrecisionSchedule, get_recipe

    if isinstance(stages, (str, bytes)) or not hasattr(stages, "__len__") or len(stages) == 0:
        raise ValueError(
            f"aligned_schedule must be a non-empty list of [start_step, recipe] pairs, got {stages!r}"
        )
    pairs = []
    for i, stage in enumerate(stages):
        if isinstance(stage, (str, bytes)) or not hasattr(stage, "__len__") or len(stage) != 2:
            raise ValueError(f"aligned_schedule[{i}] must be a [start_step, recipe] pair, got {stage!r}")
        start, recipe = stage[0], stage[1]
        if not isinstance(recipe, str) or recipe not in RECIPES:
            raise ValueError(
                f"aligned_schedule[{i}] recipe {recipe!r} is not a quantization recipe; known: {sorted(RECIPES)}"
            )
        pairs.append((start, recipe))
    try:
        PrecisionSchedule(pairs)  # start steps: ints >= 0, strictly increasing, the first at 0
    except ValueError as err:
        raise ValueError(f"aligned_schedule: {err}") from err
    if aligned_quantization is not None:
        check_aligned_quantization(aligned_quantization)
        if get_recipe(aligned_quantization) != get_recipe(pairs[0][1]):
            raise ValueError(
                f"aligned_quantization={aligned_quantization!r} contradicts aligned_schedule, whose first stage "
                f"runs {pairs[0][1]!r}: the aligned forward starts at the first stage's recipe (with "
                "corrector=qarl, aligned_quantization follows rollout.precision: set the rollout to the first "
                "stage's precision)"
            )
    return tuple(pairs)


def _check_ids_and_mask(ids: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        raise ValueError(f"{name}_ids must be a [B, L] long tensor, got {getattr(ids, 'dtype', type(ids))}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"{name}_mask must be a bool tensor (True = real token)")
    if mask.shape != ids.shape:
        raise ValueError(
            f"{name}_mask has shape {tuple(mask.shape)} but {name}_ids has shape {tuple(ids.shape)}"
        )


def build_sequences(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate left-padded prompts and right-padded responses into model inputs.

    prompt_ids/prompt_mask: ``[B, P]`` (True on real tokens, padding on the left, at least one real token);
    response_ids/response_mask: ``[B, T]`` (True on valid response tokens).
    Returns ``input_ids`` ``[B, P+T]`` long, ``attention_mask`` ``[B, P+T]`` long (1 = attend, the Hugging Face
    convention) and ``position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)`` ``[B, P+T]``.
    """
    _check_ids_and_mask(prompt_ids, prompt_mask, "prompt")
    _check_ids_and_mask(response_ids, response_mask, "response")
    if prompt_ids.shape[0] != response_ids.shape[0]:
        raise ValueError(
            f"prompt_ids has batch size {prompt_ids.shape[0]} but response_ids has {response_ids.shape[0]}"
        )
    if prompt_ids.shape[1] == 0 or not bool(prompt_mask[:, -1].all()):
        raise ValueError(
            "prompt_mask must be left-padded with a real last token in every row (prompt_mask[:, -1])"
        )
    if not bool((prompt_mask[:, 1:] >= prompt_mask[:, :-1]).all()):
        raise ValueError("prompt_mask must be left-padded: False* then True+ in every row")
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, P+T]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()  # [B, P+T]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P+T]
    return input_ids, attention_mask, position_ids


def _head_logprobs(
    lm_head: nn.Module,
    transform: LogitTransform,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    compute_entropy: bool,
    entropy_grad: bool = True,
    head_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's head + temperature log-softmax on one chunk: ``hidden`` [n, H], ``tokens`` [n] ->
    log-probs, entropies and impurities, each [n] (zeros unless ``compute_entropy``). ``head_float32``: the
    head's projection in fp32 (:func:`ais_lightning.models.head.head_logits`).

    The impurities are values only, and so are the entropies without ``entropy_grad``: autograd records
    only what a loss differentiates. A checkpointed chunk recomputes in backward every tensor its forward
    recorded, and the ones no backward consumes (the entropy's, ~5 ``[n, V]`` when the loss has no entropy
    term) stay alive until the whole backward ends, chunk after chunk: the head's memory would grow with the
    batch instead of being bounded by the chunk.
    """
    logits = transform(head_logits(lm_head, hidden, head_float32))  # [n, V]
    logprobs = logprobs_from_logits(logits, tokens, temperature)  # [n]
    if not compute_entropy:
        return logprobs, torch.zeros_like(logprobs), torch.zeros_like(logprobs)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        logp = tempered_log_softmax(logits, temperature)  # [n, V], once for both
        entropy = entropy_from_logprobs(logp)
    with torch.no_grad():
        impurity = impurity_from_logprobs(logp)
    return logprobs, entropy, impurity


def chunked_response_logprobs(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_size: int = 1024,
    transform: LogitTransform | None = None,
    entropy_grad: bool = True,
    head_float32: bool = False,
) -> ResponseLogprobs:
    """Log-probs (and entropies) of response tokens from the decoder's final hidden states.

    ``hidden`` ``[B, T, H]`` is the hidden state that *predicts* each response token (position ``P-1+t``).
    ``transform``: what the model's forward does to ``lm_head``'s logits
    (:func:`ais_lightning.models.head.logit_transform`; None = nothing). ``head_float32``: ``lm_head``'s
    projection computed in fp32 from the model-dtype hidden states and weights (``Policy(head_dtype="float32")``).
    Only valid tokens are projected, ``chunk_size`` of them at a time; under autograd each chunk is
    activation-checkpointed, so only one chunk's ``[chunk_size, V]`` logits and what is computed from them
    are alive at a time, in forward *and* backward (the memory bound of chunked cross-entropy, e.g.
    Liger-Kernel's fused linear CE). The impurities never carry a gradient, the entropies only with
    ``entropy_grad`` (False: values for metrics and correctors), so backward recomputes only what it
    differentiates: with entropy gradients that no loss consumes, every chunk's entropy tensors would stay
    alive to the end of backward (2.8 GB for 2048 tokens of a 49k vocabulary, instead of 1.0 GB).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    flat_hidden = hidden[response_mask]  # [N, H]
    flat_tokens = response_ids[response_mask]  # [N]
    use_checkpoint = torch.is_grad_enabled() and flat_hidden.requires_grad
    transform = transform if transform is not None else LogitTransform()
    chunks: list[
        tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ] = []  # (log-prob, entropy, impurity) [n] each
    for h, tok in zip(flat_hidden.split(chunk_size), flat_tokens.split(chunk_size)):
        if use_checkpoint:
            chunks.append(
                checkpoint(
                    _head_logprobs,
                    lm_head,
                    transform,
                    h,
                    tok,
                    temperature,
                    compute_entropy,
                    entropy_grad,
                    head_float32,
                    use_reentrant=False,
                )
            )
        else:
            chunks.append(
                _head_logprobs(
                    lm_head, transform, h, tok, temperature, compute_entropy, entropy_grad, head_float32
                )
            )
    zeros = torch.zeros(response_ids.shape, dtype=torch.float32, device=hidden.device)  # [B, T]
    columns = list(zip(*chunks)) if compute_entropy else [[c[0] for c in chunks]]  # the ones computed
    per_token = [zeros.masked_scatter(response_mask, torch.cat(parts)) for parts in columns]  # [B, T] each
    return ResponseLogprobs(*per_token) if compute_entropy else ResponseLogprobs(per_token[0], entropy=None)


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _cpu_tensors(
    named: Iterable[tuple[str, torch.Tensor]], snapshot: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """``named`` with every tensor detached and on the CPU, each distinct tensor copied once.

    ``snapshot``: CPU tensors are cloned (they never alias the originals); False: a CPU tensor is passed as
    is (no copy; only for a consumer that copies it at once). Names sharing one tensor (a tied
    ``lm_head.weight`` and ``embed_tokens.weight``) share one copy, as the originals share one storage.
    """
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    out = []
    for name, t in named:
        t = t.detach()
        key = (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
        if key not in copies:
            on_cpu = t.device.type == "cpu"
            copies[key] = t.cpu() if not on_cpu else (t.clone() if snapshot else t)
        out.append((name, copies[key]))
    return out


def _fsdp1_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP1 (``FullyShardedDataParallel``) instances in ``module``'s tree."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]


def _prefix_in(root: nn.Module, module: nn.Module) -> str | None:
    """The state-dict prefix of ``module`` inside ``root`` (wrapper names removed, ``""`` for the root
    itself, with a trailing dot otherwise), or None when ``module`` is not in ``root``'s tree."""
    for name, sub in root.named_modules():
        if sub is module:
            name = _clean_name(name + ".") if name else ""
            return name
    return None


def _is_fsdp_module(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(module, FSDPModule)


def _decoder_logprobs(
    model: nn.Module,
    transform: LogitTransform,
    head_float32: bool,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    compute_entropy: bool,
    chunk_size: int,
    entropy_grad: bool = True,
) -> LogprobTensors:
    """Run the decoder body of ``model`` once, then the chunked head on the response positions."""
    P = input_ids.shape[1] - response_ids.shape[1]
    hidden = decoder_hidden_states(model, input_ids, attention_mask, position_ids)  # [B, P+T, H]
    result = chunked_response_logprobs(
        model.get_output_embeddings(), hidden[:, P - 1 : -1], response_ids, response_mask,
        temperature, compute_entropy, chunk_size, transform, entropy_grad, head_float32,
    )  # fmt: skip
    return result.logprobs, result.entropy, result.impurity


class Policy(nn.Module):
    """A Hugging Face causal LM with the few methods RL training needs.

    Any causal LM: the log-probs are those of the model's own forward (its logit transform included,
    checked against it at construction: :mod:`ais_lightning.models.head`). ``disable_dropout`` (default,
    as TRL's GRPO) sets every dropout probability to 0, so pi_old, the loss's pi and the importance ratio
    against the engine are deterministic functions of the weights. ``gradient_checkpointing`` recomputes
    each decoder layer in backward instead of keeping its activations
    (:func:`enable_activation_checkpointing`): less memory, about one more forward of time. ``chat_template``
    prompts an instruction-tuned model in its tokenizer's chat template (:meth:`encode_prompts`). ``head_dtype``
    (:data:`ais_lightning.models.head.HEAD_DTYPES`): ``"float32"`` computes ``lm_head``'s projection in fp32 from the
    model-dtype hidden states and weights (TRL's ``cast_lm_head_to_fp32``, but the weights keep their dtype, so the
    engines receive the same head); None / ``"auto"`` / ``"model"``: in the model's dtype. The model is put
    in training mode (``from_pretrained`` returns it in eval mode, and Lightning keeps each module's mode
    through ``fit``, so checkpointing, which acts in training mode only, would otherwise be off).

    Under FSDP2, ``fully_shard`` each decoder layer, then ``policy.model`` and/or the Policy (or its parent).
    The decoder body and the chunked head are called directly rather than through ``model.forward``; when
    ``policy.model`` is an FSDP module that computation is registered as one of its forward methods
    (``register_fsdp_forward_method``), so embeddings, final norm and lm_head are gathered for it.
    """

    MODEL_FAMILY: ClassVar[str] = "autoregressive"
    """The family of model it scores (a subclass for another family overrides it, e.g. ``DiffusionPolicy``)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        logprob_chunk_size: int = 1024,
        aligned_quantization: str | None = None,
        aligned_schedule: Any = None,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
        chat_template: bool = False,
        head_dtype: str | None = None,
        router_replay: bool = False,
    ) -> None:
        super().__init__()
        head_float32 = check_head_dtype(head_dtype)
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise ValueError(
                f"model must be a Hugging Face causal LM with an output embedding, got {type(model)}"
            )
        if (
            isinstance(logprob_chunk_size, bool)
            or not isinstance(logprob_chunk_size, int)
            or logprob_chunk_size < 1
        ):
            raise ValueError(f"logprob_chunk_size must be an int >= 1, got {logprob_chunk_size!r}")
        self.model = model.train()  # Hugging Face's from_pretrained returns eval mode; Lightning keeps modes
        if disable_dropout:
            disable_dropout_in(model)
        routers = moe_routers(model)
        self.routing_replay = RoutingReplay(routers) if routers else None
        """The hooks on a mixture-of-experts model's routers (None for a dense model): they replay the engine's
        routing when :attr:`router_replay`, and keep the trainer's own top-k of the last scored batch
        (``routing_replay.last_routing()``) for the routing-disagreement metric either way."""
        if gradient_checkpointing:  # a recomputed layer routes as its forward did
            replay = self.routing_replay
            enable_activation_checkpointing(model, replay.checkpoint_contexts if replay is not None else None)
        if head_float32 and not isinstance(
            getattr(model.get_output_embeddings(), "weight", None), torch.Tensor
        ):
            raise ValueError(
                f"head_dtype='float32' needs a linear output layer with a weight, got "
                f"{type(model.get_output_embeddings()).__name__}"
            )
        self.head_dtype = head_dtype
        """The precision of ``lm_head``'s projection (:data:`ais_lightning.models.head.HEAD_DTYPES`)."""
        self.head_float32 = head_float32
        """Whether ``lm_head``'s projection computes in fp32 (``head_dtype="float32"``)."""
        self.logit_transform = self._checked_logit_transform(model)
        """What the model's forward does to ``lm_head``'s logits (Granite's scaling, Gemma 2's soft cap, ...),
        applied by the chunked head too (:mod:`ais_lightning.models.head`)."""
        self.tokenizer = tokenizer
        """The Hugging Face tokenizer of the model (None if the caller encodes prompts itself)."""
        if chat_template and tokenizer is not None:
            check_chat_template(tokenizer, "the policy's tokenizer")
        self.chat_template = chat_template
        """Prompts are one user message in the tokenizer's chat template (:meth:`encode_prompts`)."""
        self.logprob_chunk_size = logprob_chunk_size
        """Response positions per chunk in :meth:`batch_logprobs`: bounds the ``[chunk, V]`` logits memory."""
        if aligned_quantization is not None:
            check_aligned_quantization(aligned_quantization)
        if aligned_schedule is not None:
            aligned_schedule = check_aligned_schedule(aligned_schedule, aligned_quantization)
            aligned_quantization = aligned_schedule[0][1]
        self.aligned_quantization = aligned_quantization
        """QaRL's rollout-aligned forward: the ``ais_lightning.quant`` recipe the trainer's linears run through
        once :meth:`apply_aligned_quantization` is called (None = plain high-precision forward). With a
        schedule: the first stage's recipe."""
        self.aligned_schedule: tuple[tuple[int, str], ...] | None = aligned_schedule
        """Progressive precision (Bit-by-Bit, arXiv 2604.07888): ``((start_rollout_step, recipe), ...)``, the
        aligned forward's recipe by stage (:meth:`set_aligned_step` moves to a step's stage); None = one recipe."""
        self.router_replay = self._check_router_replay(model, router_replay)
        """Rollout routing replay (R3): the forward routes each token through the experts the engine picked
        (``RolloutBatch.routing``), with gate weights from the trainer's own router (:mod:`ais_lightning.models.routing`)."""

    @staticmethod
    def _check_router_replay(model: nn.Module, router_replay: bool) -> bool:
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

    @staticmethod
    def _checked_logit_transform(model: nn.Module) -> LogitTransform:
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

    def apply_aligned_quantization(self) -> bool:
        """QaRL (arXiv 2604.07853): run the trainer's linears through the rollout's quantization recipe.

        Emulated quantization with straight-through gradients to the fp32 master weights; parameter and
        state-dict names are unchanged, so weight sync and checkpoints work as before. Call it after any
        warm start (which trains the plain forward); idempotent. Returns whether the forward is aligned.
        """
        if self.aligned_quantization is None:
            return False
        from ais_lightning.quant import QuantLinear, get_recipe, quantize_model

        if not any(isinstance(m, QuantLinear) for m in self.model.modules()):
            quantize_model(self.model, get_recipe(self.aligned_quantization), backend="emulate")
        return True

    def aligned_stage_at(self, step: int) -> int:
        """Index of the :attr:`aligned_schedule` stage active at rollout step ``step`` (0 without a schedule)."""
        if self.aligned_schedule is None:
            return 0
        from ais_lightning.quant import PrecisionSchedule

        return PrecisionSchedule(self.aligned_schedule).stage_at(step)

    def aligned_recipe_at(self, step: int) -> str | None:
        """The recipe name the aligned forward runs at rollout step ``step`` (None: no aligned forward)."""
        if self.aligned_schedule is None:
            return self.aligned_quantization
        return self.aligned_schedule[self.aligned_stage_at(step)][1]

    def set_aligned_step(self, step: int) -> str | None:
        """Move the aligned forward to the recipe of rollout step ``step``; returns that recipe's name.

        Quantizes first if :meth:`apply_aligned_quantization` has not run. A stage change switches every
        quantized linear in place (:func:`ais_lightning.quant.switch_recipe`): the fp32 master weights, the
        state dict and the optimizer state are untouched, so the stage is a function of the step alone and a
        resumed run lands in the right stage. Returns None (and changes nothing) without an aligned forward.
        """
        recipe = self.aligned_recipe_at(step)
        if recipe is None:
            return None
        from ais_lightning.quant import QuantLinear, get_recipe, switch_recipe

        self.apply_aligned_quantization()
        target = get_recipe(recipe)
        if any(m.recipe != target for m in self.model.modules() if isinstance(m, QuantLinear)):
            switch_recipe(self.model, target, backend="emulate")
        return recipe

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        dtype: torch.dtype = torch.float32,
        attn_implementation: str | None = None,
        tokenizer: Any = None,
        logprob_chunk_size: int = 1024,
        aligned_quantization: str | None = None,
        aligned_schedule: Any = None,
        disable_dropout: bool = True,
        gradient_checkpointing: bool = False,
        chat_template: bool = False,
        head_dtype: str | None = None,
        **model_kwargs,
    ) -> Policy:
        """Load a causal LM from a *local* directory (never the hub). ``attn_implementation`` None lets
        transformers pick (as ``AutoModelForCausalLM`` does for the engines); the in-memory tiny model uses
        ``"eager"``. ``tokenizer``, ``logprob_chunk_size``, ``aligned_quantization``, ``aligned_schedule``,
        ``disable_dropout``, ``gradient_checkpointing``, ``chat_template``, ``head_dtype``: as in the constructor."""
        from transformers import AutoModelForCausalLM

        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"path must be a local model directory, got {path!r}")
        if attn_implementation is not None:
            model_kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **model_kwargs)
        return cls(
            model,
            tokenizer=tokenizer,
            logprob_chunk_size=logprob_chunk_size,
            aligned_quantization=aligned_quantization,
            aligned_schedule=aligned_schedule,
            disable_dropout=disable_dropout,
            gradient_checkpointing=gradient_checkpointing,
            chat_template=chat_template,
            head_dtype=head_dtype,
        )

    @property
    def config(self):
        return self.model.config

    @property
    def pad_token_id(self) -> int | None:
        return self.model.config.pad_token_id

    @property
    def eos_token_id(self) -> int | list[int] | None:
        return self.model.config.eos_token_id

    def decoder_layers(self) -> list[nn.Module]:
        """The transformer blocks of the decoder body (what FSDP2 shards one by one)."""
        body = decoder_body(self.model)
        for name in _LAYER_LIST_NAMES:
            layers = getattr(body, name, None)
            if isinstance(layers, nn.ModuleList):
                return list(layers)
        raise ValueError(
            f"cannot find the decoder layers of {type(body).__name__} (looked for {_LAYER_LIST_NAMES})"
        )

    def fresh_model(self) -> nn.Module:
        """A new, unsharded CPU model of the same config, dtype and attention implementation.

        Its weights are freshly initialized: load the real ones with :func:`load_named_tensors` (or an
        engine's ``sync_weights``) from :meth:`full_state_dict`. Works while ``self.model`` is sharded.
        """
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(self.model.config)
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=config._attn_implementation
        )

    def _logprobs_fn(self) -> Callable[..., LogprobTensors]:
        """The decoder + chunked-head computation, registered as an FSDP2 forward method of ``self.model``
        when that is sharded, so its parameters are gathered and its backward hooks attach to the outputs."""
        fn = getattr(self.model, _FSDP_FORWARD_METHOD, None)
        if fn is not None:
            return fn
        fn = functools.partial(_decoder_logprobs, self.model, self.logit_transform, self.head_float32)
        if _is_fsdp_module(self.model):
            from torch.distributed.fsdp import register_fsdp_forward_method

            setattr(self.model, _FSDP_FORWARD_METHOD, fn)
            register_fsdp_forward_method(self.model, _FSDP_FORWARD_METHOD)
            fn = getattr(self.model, _FSDP_FORWARD_METHOD)
        return fn

    def forward(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        chunk_size: int = 1024,
        entropy_grad: bool = True,
        routing: torch.Tensor | None = None,
    ) -> LogprobTensors:
        """``(logprobs, entropy, impurity)`` as plain tensors (so FSDP/DDP hooks see them; the last two None
        unless ``compute_entropy``); see :meth:`response_logprobs`."""
        input_ids, attention_mask, position_ids = build_sequences(
            prompt_ids, prompt_mask, response_ids, response_mask
        )
        fn = functools.partial(
            self._logprobs_fn(), input_ids, attention_mask, position_ids, response_ids, response_mask,
            temperature, compute_entropy, chunk_size, entropy_grad,
        )  # fmt: skip
        if self.routing_replay is None:
            return fn()
        replayed = routing if self.router_replay else None
        mask = routing_replay_mask(prompt_mask, response_mask) if replayed is not None else None
        with self.routing_replay.replay(replayed, mask, tuple(input_ids.shape)):
            return fn()

    def response_logprobs(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        chunk_size: int = 1024,
        entropy_grad: bool = True,
        routing: torch.Tensor | None = None,
    ) -> ResponseLogprobs:
        """Log-prob of each response token under ``softmax(logits / temperature)``.

        prompt_ids/prompt_mask ``[B, P]`` left-padded; response_ids/response_mask ``[B, T]`` right-padded.
        The decoder body runs once; ``lm_head`` + log-softmax run on ``chunk_size`` valid tokens at a time,
        so the ``[B, T, V]`` logits never fully exist. Gradients flow to the model (use ``torch.no_grad()``
        for pi_old); to the entropies only with ``entropy_grad`` (False: values only, and a lighter backward;
        the log-probs and their gradients are the same either way), never to the impurities. ``routing``: the
        engine's ``[B, P + T, L, k]`` expert ids (``RolloutBatch.routing``), replayed when :attr:`router_replay`.
        """
        logprobs, entropy, impurity = self(
            prompt_ids, prompt_mask, response_ids, response_mask, temperature, compute_entropy, chunk_size,
            entropy_grad, routing,
        )  # fmt: skip
        return ResponseLogprobs(logprobs=logprobs, entropy=entropy, impurity=impurity)

    def encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of task prompts as this model is prompted: raw text, or with ``chat_template`` one user
        message in its tokenizer's chat template (:func:`ais_lightning.models.prompting.encode_prompts`)."""
        if self.tokenizer is None:
            raise ValueError("Policy.encode_prompts needs the policy's tokenizer (Policy(model, tokenizer))")
        return encode_prompts(self.tokenizer, prompts, self.chat_template)

    def batch_logprobs(
        self,
        batch: RolloutBatch,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        entropy_grad: bool = True,
    ) -> ResponseLogprobs:
        """Log-probs (and entropies) of a rollout batch's response tokens under this policy: pi for the
        importance ratio against the engine's mu. Every model family implements this one method; an
        autoregressive LM scores each token given the prompt and the tokens before it. ``entropy_grad=False``:
        the entropies are values only (see :meth:`response_logprobs`)."""
        return self.response_logprobs(
            *(
                autograd_usable(t)
                for t in (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
            ),
            temperature=temperature,
            compute_entropy=compute_entropy,
            chunk_size=self.logprob_chunk_size,
            entropy_grad=entropy_grad,
            routing=autograd_usable(getattr(batch, "routing", None)),
        )

    def build_engine(self, precision: str = "fp32", **engine_kwargs: Any) -> Any:
        """A :class:`ais_lightning.rollout.TorchRolloutEngine` on the current weights (``engine_kwargs``: its
        other constructor arguments), e.g. for greedy evaluation; every model family implements it."""
        from ais_lightning.rollout import TorchRolloutEngine

        return TorchRolloutEngine(self.model, precision=precision, **engine_kwargs)

    def sft_loss(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Supervised warm-start loss on reference responses: the mean token negative log-likelihood."""
        out = self.response_logprobs(
            prompt_ids, prompt_mask, response_ids, response_mask, chunk_size=self.logprob_chunk_size
        )
        return -masked_mean(out.logprobs, response_mask)

    @torch.no_grad()
    def full_state_dict(
        self, rank0_only: bool = False, fsdp_root: nn.Module | None = None, snapshot: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        """Full (unsharded) CPU copies of all parameters and buffers, named as in ``model.state_dict()``.

        Includes everything ``model.state_dict()`` holds (``lm_head.weight`` beside a tied
        ``model.embed_tokens.weight``) plus the non-persistent buffers it leaves out (rotary ``inv_freq``,
        verl #5688), so an engine's copy of the model can be made identical with :func:`load_named_tensors`.
        Sharded models are gathered with ``torch.distributed.checkpoint.state_dict.get_model_state_dict``;
        it is a collective, so call it on every rank. With ``rank0_only`` (``cpu_offload=True`` there: lower
        peak device memory) only rank 0 gets the tensors and other ranks get ``[]``; by default every rank
        gets them. The tensors are snapshots: they never alias the live parameters. ``snapshot=False`` skips
        that copy for tensors already on the CPU (an unsharded CPU model's are then its live parameters and
        buffers, detached): for a consumer that copies them at once, as every engine's ``sync_weights`` does.
        Names that share a tensor (a tied ``lm_head.weight``) share one copy.

        FSDP2 (``fully_shard``, DTensor parameters) needs nothing more. FSDP1 (``FullyShardedDataParallel``
        units inside the model, e.g. Lightning's ``FSDPStrategy`` auto-wrapping the decoder layers) needs
        ``fsdp_root``: the outermost FSDP1 module around this policy (Lightning: ``trainer.strategy.model``).
        The state dict is then taken from the root and cut down to this policy's model. Calling
        ``state_dict()`` on the inner model instead lazily initialises every wrapped layer as an FSDP root
        (its state-dict pre-hook runs ``_lazy_init``), which makes the real root's first forward fail
        FSDP's "Non-root FSDP instance's `_is_root` should not have been set" assertion (torch
        ``distributed/fsdp/_runtime_utils.py``), and with several ranks returns the root-owned embedding,
        norm and head as flat 1-D shards. Without ``fsdp_root`` an FSDP1 model raises ValueError.

        Callable inside ``torch.inference_mode`` (Lightning validates under it unless the process group is gloo
        or the strategy FSDP1, and GRPO syncs its engines at validation start): the gather runs outside it, under
        ``no_grad``, and returns normal tensors. Gathering FSDP2 DTensors inside it fails in
        ``get_model_state_dict`` ("Cannot set version_counter for inference tensor").
        """
        with torch.inference_mode(False), torch.no_grad():
            return self._full_state_dict(rank0_only, fsdp_root, snapshot)

    def _full_state_dict(
        self, rank0_only: bool, fsdp_root: nn.Module | None, snapshot: bool
    ) -> list[tuple[str, torch.Tensor]]:
        model = self.model
        if _fsdp1_modules(model):
            state = self._fsdp1_state_dict(fsdp_root, rank0_only)
            if rank0_only and not state:
                return []
        elif any(_is_dtensor(t) for t in model.parameters()):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
            state = get_model_state_dict(model, options=options)
            if rank0_only and not state:
                return []
        else:
            state = model.state_dict()
        named = list(state.items())
        seen = set(state)
        for name, buf in model.named_buffers():
            name = _clean_name(name)
            if name not in seen:
                named.append((name, buf))
                seen.add(name)
        return _cpu_tensors(named, snapshot)

    def _fsdp1_state_dict(self, fsdp_root: nn.Module | None, rank0_only: bool) -> dict[str, torch.Tensor]:
        """The full state dict of ``self.model`` taken from its FSDP1 root (see :meth:`full_state_dict`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if fsdp_root is None:
            raise ValueError(
                "fsdp_root is required: policy.model is sharded by FSDP1 (FullyShardedDataParallel); pass the "
                "outermost FSDP module around the policy (Lightning: trainer.strategy.model). Calling "
                "state_dict() on the inner model would initialise each wrapped layer as an FSDP root and "
                "break the real root's first forward"
            )
        prefix = _prefix_in(fsdp_root, self.model)
        if prefix is None or not _fsdp1_modules(fsdp_root) or fsdp_root is not _fsdp1_modules(fsdp_root)[0]:
            raise ValueError(
                f"fsdp_root must be the outermost FullyShardedDataParallel module containing policy.model, got "
                f"{type(fsdp_root).__name__}"
            )
        # FSDP1 under get_model_state_dict: FULL_STATE_DICT, offload_to_cpu = rank0_only = cpu_offload
        # (torch distributed/checkpoint/state_dict.py, _verify_options).
        options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        full = get_model_state_dict(fsdp_root, options=options)
        return {
            _clean_name(k)[len(prefix) :]: v for k, v in full.items() if _clean_name(k).startswith(prefix)
        }


@torch.no_grad()
def load_named_tensors(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``(name, tensor)`` pairs (e.g. from :meth:`Policy.full_state_dict`) into ``model`` in place.

    Covers parameters, persistent and non-persistent buffers (which ``load_state_dict`` skips).
    Raises ValueError on an unknown name or a shape mismatch; values are cast to the target's dtype.
    """
    targets = {_clean_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    targets.update({_clean_name(n): b for n, b in model.named_buffers(remove_duplicate=False)})
    for name, value in named_tensors:
        if name not in targets:
            raise ValueError(f"named_tensors has {name!r}, which is not a parameter or buffer of the model")
        target = targets[name]
        if target.shape != value.shape:
            raise ValueError(
                f"{name}: shape {tuple(value.shape)} does not match the model's {tuple(target.shape)}"
            )
        target.copy_(value.to(device=target.device, dtype=target.dtype))
