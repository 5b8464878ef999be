"""DiffusionPolicy: the trainer side of a masked-diffusion LM (LLaDA-style) for RL and SFT.

It plugs into the same seam as the autoregressive :class:`ais_lightning.policy.Policy` (which it
subclasses for ``decoder_layers`` and ``full_state_dict``): ``batch_logprobs`` (pi), ``sft_loss`` (the warm
start), ``full_state_dict``/``fresh_model`` (engine weight sync), ``tokenizer``, ``logprob_chunk_size``.

Which log-probability (read with ``docs/diffusion.md``)
----------------------------------------------------------
A diffusion sampler does not generate left to right, so "the log-prob of response token t" needs a
definition that the engine (mu, its precision) and the trainer (pi, fp32) share. This module scores the
**sampler's own unmasking path**: token ``t`` was unmasked at step ``s_t`` (``extras["unmask_step"]``) from
the canvas ``x_{s_t}`` = prompt + every token unmasked before ``s_t`` + ``<mask>`` elsewhere
(``extras["canvas_ids"]`` holds the final canvas); its log-prob is
``log softmax(f_theta(x_{s_t})_t / T)[token]``, exactly the distribution the engine drew it from
(:mod:`ais_lightning.rollout.diffusion_engine`). The GRPO module then uses, per token,
``pi(token | x_{s_t}) / mu(token | x_{s_t})``.

Why this one. The rollout is a trajectory of (positions, tokens) choices; the policy-gradient correction
for sampling it with mu instead of pi needs the ratio of the *trajectory* probabilities under the two
samplers. The probability of step ``s`` is ``P(positions S_s | x_s) * prod_{t in S_s} p(token_t | x_s)``:

- ``remasking="random"``: the positions are a uniform draw that does not depend on theta, so that factor
  is the same under pi and mu and cancels: the product of the per-token path ratios IS the trajectory
  ratio, and its log-gradient is the policy gradient of the sampler (exact correction).
- ``remasking="low_confidence"``: the kept positions are those whose candidates were most probable, so
  ``P(S_s | x_s) = prod_{j re-masked} P_{c ~ q_j}(p_j(c) < tau_s)`` (``q_j = softmax(f_j / T)`` draws the
  candidate, ``p_j = softmax(f_j)`` is its confidence, ``tau_s`` the lowest kept confidence;
  :func:`low_confidence_selection_logprobs`): it depends on theta, and on the precision. The per-token
  path ratio corrects the token choices *given the positions the engine picked*, not the choice of
  positions. The selection factor is a hard threshold on confidences: when a re-masked position's top
  token is about as confident as the kept ones (the EOS tail of a trained model, p ~ 1 everywhere), a
  rounding-size shift of ``tau_s`` moves it from ~1 to ~1 - p ~ 1e-5. Its exact pi/mu ratio is
  dominated by such near-ties (measured in ``docs/diffusion.md``: 18 nats per sequence at the 99th
  percentile at bf16, where the token factors differ by 0.28), so the token factors are what the
  correctors use. Use ``remasking="random"`` when the correction must be exact.

The alternative, diffu-GRPO's one-step mean-field estimate (d1, Zhao et al. 2025, arXiv 2504.12216;
``_get_per_token_logps`` in ``diffu-grpo/diffu_grpo_trainer.py`` of GitHub dllm-reasoning/d1: completion
fully masked, prompt tokens randomly masked, every completion token scored in one forward), is a
surrogate likelihood: it is not the probability the sampler drew any token with, so pi_mf / mu_mf is not
an importance ratio between the two samplers (a mismatch that only shows in partially unmasked contexts,
i.e. every step after the first, is invisible to it). It is not implemented here.

SFT: LLaDA's masked-token loss (``GUIDELINES.md`` of GitHub ML-GSAI/LLaDA, section SFT; Nie et al. 2025,
Eq. 5): per row a ratio ``t ~ U[0, 1)``, mask probability ``p = (1 - eps) t + eps``, every completion token
(the reference answer + EOS, the tail filled with EOS up to ``response_length``: LLaDA's SFT padding) masked
independently with probability ``p``, the prompt never masked; loss = mean over rows of
``sum_{masked} -log p_theta(x_i | x_t) / p / |answer|`` (:func:`masked_diffusion_loss`), an upper bound on
the per-token negative log-likelihood.

FSDP2: every computation goes through :meth:`DiffusionPolicy.forward` (so a sharded Policy root gathers its
parameters), and when ``policy.model`` is itself an FSDP module the scoring function is registered as one of
its forward methods (``register_fsdp_forward_method``), as the autoregressive Policy does: the body is
called directly, so the model's own ``forward`` hooks would not otherwise gather embeddings / norm / head.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ais_lightning.models.head import LogitTransform
from ais_lightning.ops import autograd_usable
from ais_lightning.policy.aligned import check_aligned_quantization
from ais_lightning.policy.builders import PolicySpec
from ais_lightning.policy.gather import is_fsdp_module
from ais_lightning.policy.policy import Policy
from ais_lightning.policy.scoring import LogprobTensors, ResponseLogprobs, chunked_response_logprobs
from ais_lightning.rollout.support import FlatSupport

if TYPE_CHECKING:
    from ais_lightning.rollout.base import RolloutBatch

__all__ = [
    "DEFAULT_MASK_EPS",
    "DiffusionPolicy",
    "TinyLLaDA",
    "forward_process",
    "low_confidence_selection_logprobs",
    "masked_diffusion_loss",
    "path_contexts",
    "selection_event_logprob",
    "tiny_diffusion_policy",
]

_FSDP_FORWARD_METHOD = "_ais_diffusion_scores"
"""Attribute under which :func:`_score_positions` is registered as an FSDP2 forward method of the model."""
DTYPES = ("float32", "bfloat16")
"""Trainer precisions of :func:`tiny_diffusion_policy`."""
DEFAULT_MASK_EPS = 1e-3
"""LLaDA's ``eps``: the mask probability is ``(1 - eps) t + eps``, never 0 (the loss divides by it)."""


# ----------------------------------------------------------------------------------------- pure math
def forward_process(
    answer_mask: torch.Tensor, eps: float = DEFAULT_MASK_EPS, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA's forward (noising) process on the answer positions.

    ``answer_mask`` ``[B, T]`` bool: positions that may be masked. Per row ``t ~ U[0, 1)``,
    ``p = (1 - eps) t + eps`` ``[B]``; each answer position is masked independently with probability ``p``.
    Returns ``(masked [B, T] bool, p [B] float32)``.
    """
    if not isinstance(answer_mask, torch.Tensor) or answer_mask.dtype != torch.bool or answer_mask.dim() != 2:
        raise ValueError("answer_mask must be a [B, T] bool tensor")
    if not 0 < eps <= 1:
        raise ValueError(f"eps must be in (0, 1], got {eps}")
    b = answer_mask.shape[0]
    t = torch.rand(b, generator=generator, device=answer_mask.device)  # [B]
    p = (1 - eps) * t + eps  # [B]
    draws = torch.rand(answer_mask.shape, generator=generator, device=answer_mask.device)  # [B, T]
    return answer_mask & (draws < p[:, None]), p


def masked_diffusion_loss(
    token_logprobs: torch.Tensor, masked: torch.Tensor, answer_mask: torch.Tensor, p_mask: torch.Tensor
) -> torch.Tensor:
    """LLaDA's SFT loss: ``mean_b [ sum_{i masked} -log p_theta(x_i | x_t) / p_b / |answer_b| ]``.

    ``token_logprobs`` ``[B, T]`` log-prob of the true token at each position given the noised sequence
    (only masked positions are read); ``masked`` ``[B, T]`` bool; ``answer_mask`` ``[B, T]`` bool (the
    positions that could be masked: ``|answer_b|`` is its row sum); ``p_mask`` ``[B]`` the masking
    probability of each row. The ``1 / p`` weight makes it an unbiased estimate of the ELBO bound
    (Nie et al. 2025, Eq. 3/5); rows of the batch weigh equally (LLaDA's ``/ answer_lengths / B``).
    """
    if token_logprobs.shape != masked.shape or masked.shape != answer_mask.shape:
        raise ValueError(
            f"token_logprobs {tuple(token_logprobs.shape)}, masked {tuple(masked.shape)} and answer_mask "
            f"{tuple(answer_mask.shape)} must have the same [B, T] shape"
        )
    if p_mask.shape != masked.shape[:1]:
        raise ValueError(f"p_mask must have shape [B]={masked.shape[0]}, got {tuple(p_mask.shape)}")
    if bool((masked & ~answer_mask).any()):
        raise ValueError("masked has positions outside answer_mask")
    if not bool((p_mask > 0).all()):
        raise ValueError("p_mask must be > 0")
    nll = torch.where(masked, -token_logprobs, torch.zeros_like(token_logprobs))  # [B, T]
    lengths = answer_mask.sum(-1).clamp(min=1).to(nll.dtype)  # [B]
    return (nll.sum(-1) / p_mask.to(nll.dtype) / lengths).mean()


def path_contexts(
    canvas_ids: torch.Tensor, unmask_step: torch.Tensor, score_mask: torch.Tensor, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partially masked canvases a diffusion sampler saw when it unmasked the scored tokens.

    ``canvas_ids`` ``[B, T]``: the final response canvas; ``unmask_step`` ``[B, T]``: the step each position
    was unmasked at (>= 0 where scored); ``score_mask`` ``[B, T]`` bool: the positions to score.
    There is one context per (row, step) that unmasked at least one scored position, in row-major order.
    Returns ``(contexts [N, T], rows [N], which [B, T])``: context ``n`` is row ``rows[n]``'s canvas at that
    step (position ``t`` shows ``canvas_ids[row, t]`` if ``unmask_step[row, t] < step``, else
    ``mask_token_id``), and ``which[b, t]`` is the context scored position ``(b, t)`` is read from (-1 where
    not scored).
    """
    if canvas_ids.shape != unmask_step.shape or canvas_ids.shape != score_mask.shape or canvas_ids.dim() != 2:
        raise ValueError(
            f"canvas_ids {tuple(canvas_ids.shape)}, unmask_step {tuple(unmask_step.shape)} and score_mask "
            f"{tuple(score_mask.shape)} must be the same [B, T] shape"
        )
    if bool((score_mask & (unmask_step < 0)).any()):
        raise ValueError("unmask_step must be >= 0 on every scored position")
    b, t = canvas_ids.shape
    n_steps = int(unmask_step.max()) + 1 if unmask_step.numel() else 1
    needed = torch.zeros((b, n_steps), dtype=torch.bool, device=canvas_ids.device)  # [B, S]
    rows_s, cols_s = score_mask.nonzero(as_tuple=True)
    needed[rows_s, unmask_step[rows_s, cols_s]] = True
    rows, steps = needed.nonzero(as_tuple=True)  # [N], [N] row-major
    context_of = torch.full((b, n_steps), -1, dtype=torch.long, device=canvas_ids.device)  # [B, S]
    context_of[rows, steps] = torch.arange(rows.numel(), device=canvas_ids.device)
    visible = unmask_step[rows] < steps[:, None]  # [N, T]
    contexts = torch.where(visible, canvas_ids[rows], mask_token_id)  # [N, T]
    which = torch.full((b, t), -1, dtype=torch.long, device=canvas_ids.device)  # [B, T]
    which[rows_s, cols_s] = context_of[rows_s, unmask_step[rows_s, cols_s]]
    return contexts, rows, which


def selection_event_logprob(
    logits: torch.Tensor, threshold: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``log P_{c ~ softmax(l / T)}(softmax(l)_c < threshold)`` per row: ``logits`` ``[M, V]``, ``threshold`` ``[M]``.

    The probability that low-confidence remasking does NOT keep a position whose candidate is drawn from
    ``softmax(l / T)`` while the lowest kept confidence is ``threshold`` (confidences are T = 1
    probabilities, as in LLaDA's ``generate.py``). ``T == 0`` (greedy): the candidate is the argmax, so it is
    0 when its probability is below ``threshold`` and ``-inf`` otherwise. ``[M]`` float32.
    """
    if logits.dim() != 2 or threshold.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [M, V] and threshold [M], got {tuple(logits.shape)}, {tuple(threshold.shape)}"
        )
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float()
    confidence = logits.softmax(-1)  # [M, V]
    below = confidence < threshold[:, None]  # [M, V]
    if temperature == 0:
        top = below.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)  # [M]
        return torch.where(top, 0.0, float("-inf"))
    logq = (logits / temperature).log_softmax(-1)  # [M, V]
    return torch.logsumexp(logq.masked_fill(~below, float("-inf")), dim=-1)  # [M], -inf if nothing is below


def _score_positions(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    targets: torch.Tensor,
    score_mask: torch.Tensor,
    temperature: float,
    compute_entropy: bool,
    chunk_size: int,
    entropy_grad: bool = True,
    support: FlatSupport | None = None,
) -> LogprobTensors:
    """Body once over ``input_ids`` ``[N, L]``, then the chunked head on the ``score_mask`` positions:
    ``(logprobs, entropy | None, impurity | None)``, ``[N, L]`` each, of ``targets`` under
    ``softmax(logits / temperature)``, renormalized over ``support``'s kept sets (in ``score_mask`` order) when
    given."""
    hidden = model.get_decoder()(input_ids, attention_mask, position_ids)  # [N, L, H]
    out = chunked_response_logprobs(
        model.get_output_embeddings(), hidden, targets, score_mask, temperature, compute_entropy, chunk_size,
        entropy_grad=entropy_grad, support=support,
    )  # fmt: skip
    return out.logprobs, out.entropy, out.impurity


def _check_sequences(prompt_ids, prompt_mask, response_ids, response_mask) -> None:
    for name, ids, mask in (("prompt", prompt_ids, prompt_mask), ("response", response_ids, response_mask)):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
            raise ValueError(f"{name}_ids must be a [B, L] long tensor")
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != ids.shape:
            raise ValueError(f"{name}_mask must be a bool tensor shaped like {name}_ids {tuple(ids.shape)}")
    if prompt_ids.shape[0] != response_ids.shape[0]:
        raise ValueError(
            f"prompt_ids has {prompt_ids.shape[0]} rows but response_ids has {response_ids.shape[0]}"
        )
    if prompt_ids.shape[1] == 0 or not bool(prompt_mask[:, -1].all()):
        raise ValueError("prompt_mask must be left-padded with a real last token in every row")


def _is_int_at_least(value: Any, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


def _unmasking_path(batch: RolloutBatch) -> tuple[torch.Tensor, ...]:
    """``(prompt_ids, prompt_mask, response_mask, canvas_ids, unmask_step)`` of a diffusion engine's batch, checked
    (ValueError naming the field) and usable by autograd: what :meth:`DiffusionPolicy.batch_logprobs` scores."""
    extras = getattr(batch, "extras", None) or {}
    missing = [k for k in ("unmask_step", "canvas_ids") if k not in extras]
    if missing:
        raise ValueError(
            f"batch.extras lacks {missing}: DiffusionPolicy scores the unmasking path recorded by "
            "DiffusionRolloutEngine"
        )
    prompt_ids, prompt_mask, response_ids, response_mask, canvas, steps = (
        autograd_usable(t)
        for t in (
            batch.prompt_ids,
            batch.prompt_mask,
            batch.response_ids,
            batch.response_mask,
            extras["canvas_ids"],
            extras["unmask_step"],
        )
    )
    _check_sequences(prompt_ids, prompt_mask, response_ids, response_mask)
    for name, value in (("canvas_ids", canvas), ("unmask_step", steps)):
        if (
            not isinstance(value, torch.Tensor)
            or value.shape != response_mask.shape
            or value.dtype != torch.long
        ):
            raise ValueError(
                f"batch.extras['{name}'] must be a long tensor of shape {tuple(response_mask.shape)}"
            )
    if bool((response_mask & (canvas != response_ids)).any()):
        raise ValueError("batch.extras['canvas_ids'] disagrees with response_ids on valid tokens")
    return prompt_ids, prompt_mask, response_mask, canvas, steps


class DiffusionPolicy(Policy):
    """A masked-diffusion LM (e.g. :class:`ais_lightning.models.TinyDiffusionLM`) with the methods RL needs.

    Args:
        model: a mask predictor with ``get_decoder()`` (bidirectional body: ``(input_ids, attention_mask,
            position_ids) -> hidden``, ``layers`` its blocks), ``get_output_embeddings()`` and
            ``config.mask_token_id`` / ``pad_token_id`` / ``eos_token_id``.
        tokenizer: its tokenizer (e.g. :func:`ais_lightning.models.build_diffusion_tokenizer`).
        logprob_chunk_size: scored positions per ``[chunk, V]`` head block.
        response_length: the response canvas length of SFT examples (answer + EOS, tail filled with EOS):
            set it to the engine's ``max_new_tokens`` so the warm start sees the canvases it will denoise;
            None = each batch's longest response.
        mask_eps: LLaDA's ``eps`` (:func:`forward_process`).
        aligned_quantization: QaRL's rollout-aligned forward (as :class:`ais_lightning.policy.Policy`).
    """

    MODEL_FAMILY: ClassVar[str] = "masked_diffusion"
    """Pairs with engines of the same ``MODEL_FAMILY`` (:class:`ais_lightning.rollout.diffusion_engine.DiffusionRolloutEngine`)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        logprob_chunk_size: int = 1024,
        response_length: int | None = None,
        mask_eps: float = DEFAULT_MASK_EPS,
        aligned_quantization: str | None = None,
    ) -> None:
        super().__init__(
            model,
            tokenizer=tokenizer,
            logprob_chunk_size=logprob_chunk_size,
            aligned_quantization=aligned_quantization,
        )
        config = getattr(model, "config", None)
        for attr in ("mask_token_id", "eos_token_id"):
            if not isinstance(getattr(config, attr, None), int):
                raise ValueError(f"model.config.{attr} must be an int, got {getattr(config, attr, None)!r}")
        if response_length is not None and (
            isinstance(response_length, bool) or not isinstance(response_length, int) or response_length < 1
        ):
            raise ValueError(f"response_length must be None or an int >= 1, got {response_length!r}")
        if not 0 < mask_eps <= 1:
            raise ValueError(f"mask_eps must be in (0, 1], got {mask_eps}")
        self.response_length = response_length
        self.mask_eps = mask_eps

    @staticmethod
    def _checked_logit_transform(model: nn.Module) -> LogitTransform:
        """A mask predictor's logits are ``lm_head(body(x))`` (its ``forward`` takes a noised canvas, not a
        causal LM's arguments): no transform, nothing to probe."""
        return LogitTransform()

    @property
    def mask_token_id(self) -> int:
        return int(self.model.config.mask_token_id)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> DiffusionPolicy:
        raise NotImplementedError(
            "DiffusionPolicy has no Hugging Face loader; build the model (e.g. build_tiny_diffusion) and wrap it"
        )

    def fresh_model(self) -> nn.Module:
        """A new, unsharded CPU model of the same class, config and dtype (weights freshly initialized; load
        the real ones from :meth:`full_state_dict`). Works while ``self.model`` is sharded; the global RNG is
        left untouched."""
        config = copy.deepcopy(self.model.config)
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        with torch.random.fork_rng(devices=[]):
            model = type(self.model)(config)
        return model.to(dtype)

    def build_engine(self, precision: str = "fp32", **engine_kwargs: Any) -> Any:
        """A :class:`ais_lightning.rollout.diffusion_engine.DiffusionRolloutEngine` on a fresh copy of the
        current weights (``engine_kwargs``: its other constructor arguments), e.g. for greedy evaluation."""
        from ais_lightning.rollout.diffusion_engine import DiffusionRolloutEngine

        engine = DiffusionRolloutEngine(self.fresh_model(), precision=precision, **engine_kwargs)
        engine.sync_weights(self.full_state_dict())
        return engine

    # ------------------------------------------------------------------ scoring
    def _scores_fn(self) -> Callable[..., LogprobTensors]:
        fn = getattr(self.model, _FSDP_FORWARD_METHOD, None)
        if fn is not None:
            return fn
        fn = functools.partial(_score_positions, self.model)
        if is_fsdp_module(self.model):
            from torch.distributed.fsdp import register_fsdp_forward_method

            setattr(self.model, _FSDP_FORWARD_METHOD, fn)
            register_fsdp_forward_method(self.model, _FSDP_FORWARD_METHOD)
            fn = getattr(self.model, _FSDP_FORWARD_METHOD)
        return fn

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        score_mask: torch.Tensor,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        chunk_size: int = 1024,
        entropy_grad: bool = True,
        support: FlatSupport | None = None,
    ) -> LogprobTensors:
        """Log-probs (and entropies, impurities) of ``targets`` at the ``score_mask`` positions of the partially
        masked sequences ``input_ids`` ``[N, L]``: ``([N, L], [N, L] | None, [N, L] | None)``, 0 elsewhere. Plain tensors, so FSDP
        hooks see them; :meth:`batch_logprobs` and :meth:`sft_loss` build the inputs. ``support``: the kept sets of
        the scored positions in ``score_mask`` order (replayed truncation)."""
        return self._scores_fn()(
            input_ids,
            attention_mask,
            position_ids,
            targets,
            score_mask,
            temperature,
            compute_entropy,
            chunk_size,
            entropy_grad,
            support,
        )

    def response_logprobs(self, *args: Any, **kwargs: Any) -> ResponseLogprobs:
        raise ValueError(
            "a masked-diffusion policy has no left-to-right response log-probs: use batch_logprobs(batch) "
            "with a RolloutBatch from DiffusionRolloutEngine (it carries extras['unmask_step'] and "
            "extras['canvas_ids']), or sft_loss for reference responses"
        )

    def batch_logprobs(
        self,
        batch: RolloutBatch,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        entropy_grad: bool = True,
    ) -> ResponseLogprobs:
        """Log pi of each response token on the sampler's path (see the module docstring), ``[B, T]`` float32.

        Needs ``batch.extras["unmask_step"]`` and ``batch.extras["canvas_ids"]`` (recorded by
        :class:`ais_lightning.rollout.DiffusionRolloutEngine`). Token ``t`` is scored under
        ``softmax(f(x_{s_t}) / temperature)`` at its unmasking step ``s_t``; the entropy is that
        distribution's. One body forward over the distinct (row, step) contexts; gradients flow when enabled
        (to the entropies only with ``entropy_grad``, as in :meth:`Policy.batch_logprobs`). With ``batch.support``
        (the tokens the engine's top-k / top-p / min-p kept when it drew each token) that distribution is
        renormalized over the recorded set, as the engine's was.
        """
        prompt_ids, prompt_mask, response_mask, canvas, steps = _unmasking_path(batch)
        b, t = response_mask.shape
        plen = prompt_ids.shape[1]
        if not bool(response_mask.any()):
            zeros = torch.zeros((b, t), dtype=torch.float32, device=canvas.device)
            if not compute_entropy:
                return ResponseLogprobs(logprobs=zeros, entropy=None)
            return ResponseLogprobs(logprobs=zeros, entropy=zeros.clone(), impurity=zeros.clone())
        contexts, rows, which = path_contexts(canvas, steps, response_mask, self.mask_token_id)  # [N, T]
        n = rows.numel()
        input_ids = torch.cat([prompt_ids[rows], contexts], dim=1)  # [N, P+T]
        attention = torch.cat([prompt_mask[rows], torch.ones_like(contexts, dtype=torch.bool)], dim=1)
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)  # [N, P+T]
        # Each scored (b, t) is read in exactly one context: mark it there, with its true token as target.
        score = torch.zeros((n, plen + t), dtype=torch.bool, device=canvas.device)  # [N, P+T]
        targets = torch.zeros((n, plen + t), dtype=torch.long, device=canvas.device)  # [N, P+T]
        rows_s, cols_s = response_mask.nonzero(as_tuple=True)
        score[which[rows_s, cols_s], plen + cols_s] = True
        targets[which[rows_s, cols_s], plen + cols_s] = canvas[rows_s, cols_s]
        kept = None
        if batch.support is not None:  # the kept sets, from (row, position) order into the scored order
            order = torch.full((n, plen + t), -1, dtype=torch.long, device=canvas.device)  # [N, P+T]
            order[which[rows_s, cols_s], plen + cols_s] = torch.arange(rows_s.numel(), device=canvas.device)
            kept = batch.support.flat(response_mask).take(order[score])
        lp, ent, imp = self(
            input_ids,
            attention,
            positions,
            targets,
            score,
            temperature,
            compute_entropy,
            self.logprob_chunk_size,
            entropy_grad,
            kept,
        )
        index = torch.where(response_mask, which, 0)  # [B, T]
        col = torch.arange(t, device=canvas.device)[None, :] + plen  # [1, T]
        logprobs = torch.where(response_mask, lp[index, col.expand(b, t)], 0.0)  # [B, T]
        if ent is None or imp is None:
            return ResponseLogprobs(logprobs=logprobs, entropy=None)
        entropy, impurity = (torch.where(response_mask, x[index, col.expand(b, t)], 0.0) for x in (ent, imp))
        return ResponseLogprobs(logprobs=logprobs, entropy=entropy, impurity=impurity)  # [B, T] each

    # ---------------------------------------------------------------------- SFT
    def sft_canvas(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """Reference responses as full canvases ``[B, T']``: the valid tokens (answer + EOS), then EOS up to
        ``response_length`` (LLaDA's SFT padding: the model learns to fill the tail with EOS)."""
        b, t = response_ids.shape
        length = t if self.response_length is None else self.response_length
        if t > length and bool(response_mask[:, length:].any()):
            raise ValueError(
                f"a reference response has more than response_length={length} tokens "
                f"(longest: {int(response_mask.sum(-1).max())})"
            )
        if not bool((response_mask[:, 1:] <= response_mask[:, :-1]).all()):
            raise ValueError("response_mask must be right-padded: True* then False* in every row")
        eos = int(self.model.config.eos_token_id)
        canvas = torch.full((b, length), eos, dtype=torch.long, device=response_ids.device)  # [B, T']
        keep = min(t, length)
        canvas[:, :keep] = torch.where(response_mask[:, :keep], response_ids[:, :keep], eos)
        return canvas

    def sft_loss(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """LLaDA's masked-token SFT loss on reference responses (module docstring; :func:`masked_diffusion_loss`).

        ``response_ids``/``response_mask`` as ``SFTModule`` encodes them (answer + EOS, right-padded). The
        masking uses the global RNG unless ``generator`` is given.
        """
        _check_sequences(prompt_ids, prompt_mask, response_ids, response_mask)
        canvas = self.sft_canvas(response_ids, response_mask)  # [B, T']
        answer = torch.ones_like(canvas, dtype=torch.bool)  # [B, T'], every canvas position is answer
        masked, p_mask = forward_process(answer, self.mask_eps, generator)  # [B, T'], [B]
        noisy = torch.where(masked, self.mask_token_id, canvas)  # [B, T']
        plen = prompt_ids.shape[1]
        input_ids = torch.cat([prompt_ids, noisy], dim=1)  # [B, P+T']
        attention = torch.cat([prompt_mask, answer], dim=1)  # [B, P+T']
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
        targets = torch.cat([prompt_ids, canvas], dim=1)  # [B, P+T']
        score = torch.cat([torch.zeros_like(prompt_mask), masked], dim=1)  # [B, P+T']
        lp, _, _ = self(input_ids, attention, positions, targets, score, 1.0, False, self.logprob_chunk_size)
        return masked_diffusion_loss(lp[:, plen:], masked, answer, p_mask)


@torch.no_grad()
def low_confidence_selection_logprobs(
    model: nn.Module, batch: RolloutBatch, schedule: list[Any], temperature: float
) -> torch.Tensor:
    """Log-probability, under ``model``, of the POSITION choices of low-confidence remasking on a batch's path.

    At step ``s`` the sampler kept the positions ``K_s`` (``extras["unmask_step"] == s``) of the block of
    ``schedule[s]`` and re-masked the other still-masked ones ``R_s`` of that block. Given the kept tokens,
    the probability that exactly ``K_s`` is kept is ``prod_{j in R_s} P_{c ~ q_j}(p_j(c) < tau_s)`` (candidates
    are drawn independently per position; ``tau_s = min_{i in K_s} p_i(x_i)``; :func:`selection_event_logprob`).
    The full path log-probability is this plus the token log-probs of every position (tail included).
    Returns ``[B, S]`` float32 (0 for steps that keep a whole block's remainder). An analysis function
    (``tools/diffusion_mismatch.py``): the correctors do not use it (see the module docstring for why).
    ``model`` is any mask predictor (the trainer's, or an engine's quantized copy: its step ``s`` forward
    over all ``B`` rows is exactly the engine's). ``schedule``: the engine's ``schedule(T)``.
    """
    canvas, steps = batch.extras["canvas_ids"], batch.extras["unmask_step"]
    b, t = canvas.shape
    if len(schedule) != int(steps.max()) + 1:
        raise ValueError(f"schedule has {len(schedule)} steps but the batch used {int(steps.max()) + 1}")
    mask_id = int(model.config.mask_token_id)
    attention = torch.cat([batch.prompt_mask, torch.ones_like(canvas, dtype=torch.bool)], dim=1)  # [B, P+T]
    positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
    plen = batch.prompt_ids.shape[1]
    cols = torch.arange(t, device=canvas.device)[None, :]  # [1, T]
    out = torch.zeros((b, len(schedule)), dtype=torch.float32, device=canvas.device)  # [B, S]
    for s, step in enumerate(schedule):
        in_block = (cols >= step.block_start) & (cols < step.block_end)  # [1, T]
        kept, rest = steps == s, in_block & (steps > s)  # [B, T]
        if not bool(rest.any()):
            continue
        context = torch.where(steps < s, canvas, mask_id)  # [B, T]
        hidden = model.get_decoder()(torch.cat([batch.prompt_ids, context], dim=1), attention, positions)
        logits = model.get_output_embeddings()(hidden[:, plen:]).float()  # [B, T, V]
        conf = logits.softmax(-1).gather(-1, canvas[..., None]).squeeze(-1)  # [B, T]
        tau = torch.where(kept, conf, float("inf")).min(-1).values  # [B]
        rows, where = rest.nonzero(as_tuple=True)
        logp = selection_event_logprob(logits[rows, where], tau[rows], temperature)  # [M]
        out[:, s].index_add_(0, rows, logp)
    return out


def tiny_diffusion_policy(
    seed: int = 0,
    dtype: str = "float32",
    response_length: int | None = 8,
    logprob_chunk_size: int = 1024,
    mask_eps: float = DEFAULT_MASK_EPS,
    aligned_quantization: str | None = None,
) -> DiffusionPolicy:
    """The built-in tiny masked-diffusion LM with its tokenizer (``policy.tokenizer``); nothing is downloaded.

    ``seed`` initializes the weights; ``dtype`` is the trainer precision (``float32`` | ``bfloat16``);
    ``response_length`` is the SFT canvas length (keep it equal to the rollout's ``max_new_tokens``); the
    rest as in :class:`DiffusionPolicy`.
    """
    from ais_lightning.models.tiny_diffusion import build_diffusion_tokenizer, build_tiny_diffusion

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DiffusionPolicy(
        build_tiny_diffusion(seed=seed).to(getattr(torch, dtype)),
        tokenizer=build_diffusion_tokenizer(),
        logprob_chunk_size=logprob_chunk_size,
        response_length=response_length,
        mask_eps=mask_eps,
        aligned_quantization=aligned_quantization,
    )


@dataclass
class TinyLLaDA(PolicySpec):
    """Config spec of the built-in tiny masked-diffusion policy (``policy=tiny_llada``): validates on
    construction (config time, nothing built), :meth:`build` makes the policy (as ``policy.builders``' specs)."""

    dtype: str = "float32"
    """Trainer precision: float32 or bfloat16."""
    logprob_chunk_size: int = 1024
    """Scored positions per chunk when computing log-probs/entropy (bounds the [chunk, V] logits)."""
    response_length: int | None = 8
    """SFT canvas length (answer + EOS, tail filled with EOS); keep it equal to the rollout's max_new_tokens."""
    mask_eps: float = DEFAULT_MASK_EPS
    """LLaDA's minimum masking probability in the SFT loss."""
    aligned_quantization: str | None = None
    """QaRL: an ``ais_lightning.quant`` recipe the trainer's forward runs through (None = off)."""

    MODEL_FAMILY: ClassVar[str] = DiffusionPolicy.MODEL_FAMILY
    """The family of the policy it builds (not a config field)."""
    PRETRAINED_WEIGHTS: ClassVar[bool] = False
    """Starts from random weights (``warmstart.enabled=auto`` warm-starts it)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if not _is_int_at_least(self.logprob_chunk_size, 1):
            raise ValueError(f"logprob_chunk_size must be an int >= 1, got {self.logprob_chunk_size!r}")
        if self.response_length is not None and not _is_int_at_least(self.response_length, 1):
            raise ValueError(f"response_length must be None or an int >= 1, got {self.response_length!r}")
        if not 0 < self.mask_eps <= 1:
            raise ValueError(f"mask_eps must be in (0, 1], got {self.mask_eps}")
        if self.aligned_quantization is not None:
            check_aligned_quantization(self.aligned_quantization)

    def build(self, seed: int = 0) -> DiffusionPolicy:
        """The policy, its weights initialized from ``seed``."""
        return tiny_diffusion_policy(seed=seed, **dataclasses.asdict(self))
