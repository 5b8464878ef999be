"""Policy: a thin ``nn.Module`` around a Hugging Face causal LM for RL training.

It computes the log-prob (and optionally the entropy) of each response token under the
temperature-processed policy, without ever materializing the full ``[B, T, V]`` logits, and exports
the full (unsharded) weights and buffers for rollout-engine weight sync. The class wires pieces that each
do one job:

- :mod:`ais_lightning.policy.scoring`: sequences, the decoder once and the chunked head (log-probs, entropy);
- :mod:`ais_lightning.policy.gather`: full weights out of FSDP1/FSDP2 and into an engine's model;
- :mod:`ais_lightning.policy.aligned`: QaRL's aligned forward and Bit-by-Bit's schedule of recipes;
- :mod:`ais_lightning.policy.model_checks`: what the wrapped model must be (head, logit transform, routers);
- :mod:`ais_lightning.policy.loading`: a local checkpoint, or a fresh copy of the model for an engine;
- :mod:`ais_lightning.models.prompting` (chat template) and :mod:`ais_lightning.models.routing` (MoE routing
  replay).

The names tests and tools import from this module (``build_sequences``, ``check_aligned_schedule``, ...) are
re-exported here.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ais_lightning.models.head import LogitTransform, check_head_dtype, decoder_body
from ais_lightning.models.prompting import check_chat_template, encode_prompts
from ais_lightning.models.routing import RoutingReplay, moe_routers, routing_replay_mask
from ais_lightning.models.training import disable_dropout_in, enable_activation_checkpointing
from ais_lightning.ops import autograd_usable, masked_mean
from ais_lightning.policy.aligned import (
    aligned_options,
    check_aligned_quantization,
    check_aligned_schedule,
    quantize_aligned,
    schedule_recipe,
    schedule_stage,
    switch_aligned,
)
from ais_lightning.policy.gather import full_state_dict, is_fsdp_module, load_named_tensors
from ais_lightning.policy.loading import fresh_causal_lm, load_causal_lm
from ais_lightning.policy.model_checks import (
    HEAD_TOLERANCE,
    check_causal_lm,
    check_chunk_size,
    check_float32_head,
    check_router_replay,
    checked_logit_transform,
)
from ais_lightning.policy.scoring import (
    LogprobTensors,
    ResponseLogprobs,
    build_sequences,
    chunked_response_logprobs,
    decoder_logprobs,
)

if TYPE_CHECKING:
    from ais_lightning.rollout.base import RolloutBatch
    from ais_lightning.rollout.support import SamplingSupport

__all__ = [
    "HEAD_TOLERANCE",
    "LogprobTensors",
    "Policy",
    "ResponseLogprobs",
    "build_sequences",
    "check_aligned_quantization",
    "check_aligned_schedule",
    "chunked_response_logprobs",
    "load_named_tensors",
]

_LAYER_LIST_NAMES = ("layers", "h", "blocks")
"""Attribute names under which Hugging Face decoder bodies keep their ``nn.ModuleList`` of blocks."""
_FSDP_FORWARD_METHOD = "_ais_policy_response_logprobs"
"""Attribute under which the log-prob computation is registered as an FSDP2 forward method of the model."""


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

    Example:
        >>> import torch
        >>> from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3
        >>> from ais_lightning.policy import Policy
        >>> from ais_lightning.rollout import SamplingConfig
        >>> policy = Policy(build_tiny_qwen3(seed=0), build_char_tokenizer())
        >>> engine = policy.build_engine("fp32")  # a rollout engine on a copy of the weights
        >>> batch = engine.generate(policy.encode_prompts(["1+2="]), SamplingConfig(n=2, max_new_tokens=4, seed=0))
        >>> with torch.no_grad():
        ...     scored = policy.batch_logprobs(batch, temperature=1.0, compute_entropy=True)
        >>> scored.logprobs.shape, scored.entropy.shape  # log pi and the entropy of each response token [n, T]
        (torch.Size([2, 4]), torch.Size([2, 4]))
        >>> bool((scored.logprobs - batch.rollout_logprobs)[batch.response_mask].abs().max() < 1e-4)  # same weights
        True
        >>> engine.sync_weights(policy.full_state_dict())  # full, unsharded (name, tensor) pairs, e.g. after a step
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
        check_causal_lm(model)
        check_chunk_size(logprob_chunk_size)
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
        if head_float32:
            check_float32_head(model)
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
        aligned_quantization, aligned_schedule = aligned_options(aligned_quantization, aligned_schedule)
        self.aligned_quantization = aligned_quantization
        """QaRL's rollout-aligned forward: the ``ais_lightning.quant`` recipe the trainer's linears run through
        once :meth:`apply_aligned_quantization` is called (None = plain high-precision forward). With a
        schedule: the first stage's recipe."""
        self.aligned_schedule: tuple[tuple[int, str], ...] | None = aligned_schedule
        """Progressive precision (Bit-by-Bit, arXiv 2604.07888): ``((start_rollout_step, recipe), ...)``, the
        aligned forward's recipe by stage (:meth:`set_aligned_step` moves to a step's stage); None = one recipe."""
        self.router_replay = check_router_replay(model, router_replay)
        """Rollout routing replay (R3): the forward routes each token through the experts the engine picked
        (``RolloutBatch.routing``), with gate weights from the trainer's own router (:mod:`ais_lightning.models.routing`)."""

    @staticmethod
    def _checked_logit_transform(model: nn.Module) -> LogitTransform:
        """The model's logit transform, checked on a short probe against its own forward
        (:func:`ais_lightning.policy.model_checks.checked_logit_transform`); a subclass scoring another way
        overrides it."""
        return checked_logit_transform(model)

    def apply_aligned_quantization(self) -> bool:
        """QaRL (arXiv 2604.07853): run the trainer's linears through the rollout's quantization recipe.

        Emulated quantization with straight-through gradients to the fp32 master weights; parameter and
        state-dict names are unchanged, so weight sync and checkpoints work as before. Call it after any
        warm start (which trains the plain forward); idempotent. Returns whether the forward is aligned.
        """
        return quantize_aligned(self.model, self.aligned_quantization)

    def aligned_stage_at(self, step: int) -> int:
        """Index of the :attr:`aligned_schedule` stage active at rollout step ``step`` (0 without a schedule)."""
        return schedule_stage(self.aligned_schedule, step)

    def aligned_recipe_at(self, step: int) -> str | None:
        """The recipe name the aligned forward runs at rollout step ``step`` (None: no aligned forward)."""
        return schedule_recipe(self.aligned_quantization, self.aligned_schedule, step)

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
        self.apply_aligned_quantization()
        switch_aligned(self.model, recipe)
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
        model = load_causal_lm(path, dtype, attn_implementation, **model_kwargs)
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
        return fresh_causal_lm(self.model)

    def _logprobs_fn(self) -> Callable[..., LogprobTensors]:
        """The decoder + chunked-head computation, registered as an FSDP2 forward method of ``self.model``
        when that is sharded, so its parameters are gathered and its backward hooks attach to the outputs."""
        fn = getattr(self.model, _FSDP_FORWARD_METHOD, None)
        if fn is not None:
            return fn
        fn = functools.partial(decoder_logprobs, self.model, self.logit_transform, self.head_float32)
        if is_fsdp_module(self.model):
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
        support: SamplingSupport | None = None,
    ) -> LogprobTensors:
        """``(logprobs, entropy, impurity)`` as plain tensors (so FSDP/DDP hooks see them; the last two None
        unless ``compute_entropy``); see :meth:`response_logprobs`."""
        input_ids, attention_mask, position_ids = build_sequences(
            prompt_ids, prompt_mask, response_ids, response_mask
        )
        kept = support.flat(response_mask) if support is not None else None
        fn = functools.partial(
            self._logprobs_fn(), input_ids, attention_mask, position_ids, response_ids, response_mask,
            temperature, compute_entropy, chunk_size, entropy_grad, kept,
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
        support: SamplingSupport | None = None,
    ) -> ResponseLogprobs:
        """Log-prob of each response token under ``softmax(logits / temperature)``.

        prompt_ids/prompt_mask ``[B, P]`` left-padded; response_ids/response_mask ``[B, T]`` right-padded.
        The decoder body runs once; ``lm_head`` + log-softmax run on ``chunk_size`` valid tokens at a time,
        so the ``[B, T, V]`` logits never fully exist. Gradients flow to the model (use ``torch.no_grad()``
        for pi_old); to the entropies only with ``entropy_grad`` (False: values only, and a lighter backward;
        the log-probs and their gradients are the same either way), never to the impurities. ``routing``: the
        engine's ``[B, P + T, L, k]`` expert ids (``RolloutBatch.routing``), replayed when :attr:`router_replay`.
        ``support``: the tokens a truncated sampler kept at each response position (``RolloutBatch.support``); each
        distribution, its log-probs, entropy and impurity, is then the one renormalized over that set
        (:mod:`ais_lightning.rollout.support`).
        """
        logprobs, entropy, impurity = self(
            prompt_ids, prompt_mask, response_ids, response_mask, temperature, compute_entropy, chunk_size,
            entropy_grad, routing, support,
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
        the entropies are values only (see :meth:`response_logprobs`). When the batch carries the tokens the
        engine's truncation kept (``batch.support``: top-k, top-p, min-p), pi is renormalized over exactly those,
        as mu is, so that pi / mu is the exact ratio (:mod:`ais_lightning.rollout.support`)."""
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
            support=batch.support,
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
        self,
        rank0_only: bool = False,
        fsdp_root: nn.Module | None = None,
        snapshot: bool = True,
        device: torch.device | str | None = "cpu",
    ) -> list[tuple[str, torch.Tensor]]:
        """Full (unsharded) copies of all parameters and buffers, named as in ``model.state_dict()``, for an
        engine's ``sync_weights`` (:func:`ais_lightning.policy.gather.full_state_dict`).

        Sharded models are gathered (a collective: call it on every rank); FSDP1 needs ``fsdp_root``, the
        outermost FSDP1 module around this policy (Lightning: ``trainer.strategy.model``). With ``rank0_only``
        only rank 0 gets the tensors. The tensors never alias the live parameters unless ``snapshot=False``
        (tensors already on ``device`` then passed as they are, for a consumer that copies them at once).
        ``device``: the CPU by default; None keeps them on the policy's device (an engine on the same GPU
        needs no host round trip). Callable inside ``torch.inference_mode``.
        """
        return full_state_dict(self.model, rank0_only, fsdp_root, snapshot, device)
