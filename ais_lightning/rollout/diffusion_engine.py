"""A rollout engine for masked-diffusion LMs: LLaDA's low-confidence remasking sampler, optionally quantized.

The sampler follows ``generate.py`` of GitHub ML-GSAI/LLaDA (Nie et al. 2025, "Large Language Diffusion
Models", arXiv 2502.09992, Algorithm 5 and Appendix B.3), also used by d1's diffu-GRPO
(``diffu-grpo/diffu_grpo_trainer.py`` of GitHub dllm-reasoning/d1, Zhao et al. 2025):

1. The response is a fixed-length canvas of ``sampling.max_new_tokens`` mask tokens after the prompt.
2. It is split into blocks of ``block_length`` positions, denoised left to right (semi-autoregressive;
   one block = the whole response is plain LLaDA). Each block gets its share of ``steps`` denoising steps,
   and each step unmasks a fixed number of the block's positions (:func:`denoising_schedule`).
3. At every step the model sees prompt + canvas (bidirectional attention) and a candidate token is
   drawn at every still-masked position of the current block from ``softmax(logits / temperature)``
   (greedy at temperature 0). LLaDA draws it by Gumbel-max in float64; here the same categorical
   distribution is sampled with :func:`ais_lightning.rollout.sampling.draw_next`, the draw every engine
   of this repository uses, so mu is defined in one place.
4. ``remasking="low_confidence"``: the ``k`` candidates with the highest probability under
   ``softmax(logits)`` (temperature 1, as LLaDA) are kept, the others re-masked; ``"random"``: ``k``
   positions chosen uniformly at random. Kept tokens are never re-masked.

After the last step the response ends at the first stop token (``response_mask`` True up to and including
it, ``finish_reason`` ``"stop"``); with no stop token it is ``"length"``. A model SFT-ed like LLaDA fills the
tail with EOS. The tokens after the stop token are generated too and were visible to the model while the
earlier ones were chosen; they are kept in ``extras``.

What the engine records (the scoring contract with :class:`ais_lightning.policy.DiffusionPolicy`):

- ``rollout_logprobs[b, t]``: log mu of token ``t`` at the step it was unmasked, i.e. under the
  partially masked canvas the engine saw at that step, after temperature (T = 1 log-probs when greedy);
- ``extras["unmask_step"]`` ``[B, T]`` long: that step (0-based, counted over the whole response);
- ``extras["canvas_ids"]`` ``[B, T]`` long: the full final canvas, including the tokens after the stop
  token (``response_ids`` itself is padded after ``response_mask``, the repository-wide layout);
- ``extras["canvas_logprobs"]`` ``[B, T]`` float32: log mu of every canvas token, the tail too (for
  trajectory-level analyses; ``rollout_logprobs`` is it on ``response_mask``, 0 elsewhere).

With those, the context of every step is ``prompt + [canvas if unmask_step < s else <mask>]``, so the
policy replays the exact path with its own forward. Why the correctors use that path log-prob (and what
low-confidence remasking does to it) is explained in ``docs/diffusion.md`` and in
:mod:`ais_lightning.policy.diffusion`.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ais_lightning.checks import check_int
from ais_lightning.ops import logprobs_from_logits, pad_sequences
from ais_lightning.quant.cpu_int8 import INTEGER_BACKENDS, default_int8_backend
from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig, without_autocast
from ais_lightning.rollout.prompts import check_generate_args, check_prompts, context_length
from ais_lightning.rollout.sampling import draw_next, make_generator
from ais_lightning.rollout.support import SupportRecorder
from ais_lightning.rollout.weight_sync import check_named_tensors

__all__ = [
    "DIFFUSION_PRECISIONS",
    "REMASKING",
    "DenoisingStep",
    "DiffusionRolloutEngine",
    "denoising_schedule",
    "response_end_mask",
]

DIFFUSION_PRECISIONS = ("fp32", "bf16", "fp8", "fp4", "int8")
"""Weight/activation precisions (the torch engine's: bf16 cast, or ``ais_lightning.quant`` recipes)."""
REMASKING = ("low_confidence", "random")
"""LLaDA's remasking strategies: which of the step's candidates are kept."""
QUANT_BACKENDS = ("emulate", *INTEGER_BACKENDS)
"""``ais_lightning.quant.quantize_model`` backends this engine runs."""
_DEFAULT_BACKEND = {"fp8": "emulate", "fp4": "emulate", "int8": None}
"""The quantization backend of each quantized precision when ``backend`` is None (as the torch engine; None: this
CPU's fastest exact integer GEMM, :func:`ais_lightning.quant.cpu_int8.default_int8_backend`)."""


@dataclass(frozen=True)
class DenoisingStep:
    """One denoising step: unmask ``num_unmask`` positions among ``[block_start, block_end)`` of the response."""

    block_start: int
    block_end: int
    num_unmask: int


def denoising_schedule(
    length: int, steps: int | None = None, block_length: int | None = None
) -> list[DenoisingStep]:
    """The steps that denoise a ``length``-token response, in order.

    ``block_length`` None = one block (plain LLaDA); otherwise blocks of ``block_length`` positions left to
    right, the last one shorter when it does not divide ``length``. ``steps`` None = ``length`` (one token
    per step, LLaDA's best-quality setting). The steps are shared among the blocks as evenly as possible
    (the first ``steps % blocks`` blocks get one more), at least one and at most ``block size`` per block,
    and each block's positions are shared among its steps the same way (LLaDA's
    ``get_num_transfer_tokens``: the linear noise schedule unmasks the same expected number per step).
    When ``block_length`` divides ``length`` and ``steps`` is a multiple of the number of blocks (what LLaDA
    requires) this is LLaDA's schedule, minus the steps that would unmask nothing (more steps than
    positions in a block). Otherwise LLaDA would refuse; here the total differs from ``steps`` only when
    ``steps`` is fewer than the blocks (one step each) or more than ``length`` (one token per step).
    """
    check_int(length, "length")
    for name, value in (("steps", steps), ("block_length", block_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
    block = length if block_length is None else min(block_length, length)
    starts = list(range(0, length, block))
    total = length if steps is None else steps
    schedule = []
    for i, start in enumerate(starts):
        end = min(start + block, length)
        size = end - start
        n_steps = total // len(starts) + (1 if i < total % len(starts) else 0)
        n_steps = min(max(n_steps, 1), size)
        base, extra = divmod(size, n_steps)
        schedule += [DenoisingStep(start, end, base + (1 if j < extra else 0)) for j in range(n_steps)]
    return schedule


def response_end_mask(canvas: torch.Tensor, stop_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask [B, T] bool, stopped [B] bool)``: True up to and including the first stop token of each row.

    Rows without a stop token are valid to the end (``stopped`` False); no stop ids = every row to the end.
    """
    if canvas.dim() != 2:
        raise ValueError(f"canvas must be [B, T], got {tuple(canvas.shape)}")
    b, t = canvas.shape
    if not stop_token_ids:
        return torch.ones_like(canvas, dtype=torch.bool), torch.zeros(
            b, dtype=torch.bool, device=canvas.device
        )
    is_stop = torch.isin(
        canvas, torch.tensor(stop_token_ids, dtype=torch.long, device=canvas.device)
    )  # [B, T]
    stopped = is_stop.any(-1)  # [B]
    first = torch.where(stopped, is_stop.long().argmax(-1), torch.full_like(stopped, t - 1, dtype=torch.long))
    mask = torch.arange(t, device=canvas.device)[None, :] <= first[:, None]  # [B, T]
    return mask, stopped


def _is_int(value: Any, minimum: int) -> bool:
    try:
        return not isinstance(value, bool) and operator.index(value) >= minimum
    except TypeError:
        return False


class DiffusionRolloutEngine(RolloutEngine):
    """Samples a masked-diffusion LM (e.g. :class:`ais_lightning.models.TinyDiffusionLM`) with LLaDA's sampler.

    Args:
        model: a mask predictor with ``get_decoder()`` (``body(input_ids, attention_mask, position_ids) ->
            hidden [B, L, H]``, bidirectional) and ``get_output_embeddings()`` (hidden -> logits), and
            ``config.mask_token_id`` unless ``mask_token_id`` is given. It is deep-copied; the caller's
            module is never modified.
        precision: ``fp32`` | ``bf16`` | ``fp8`` (blockwise E4M3 W8A8) | ``fp4`` (NVFP4) | ``int8``.
        backend: quantization backend for fp8/fp4/int8 (``"emulate"``, or an integer W8A8 GEMM for int8:
            ``"int8"`` = ``torch._int_mm``, ``"fbgemm"``); None: fp8/fp4 -> emulate, int8 -> the fastest exact
            backend of this CPU (the torch engine's choices).
        steps: denoising steps for the whole response; None = one per response token
            (see :func:`denoising_schedule`).
        block_length: positions per semi-autoregressive block; None = the whole response is one block.
        remasking: ``"low_confidence"`` (LLaDA's default) or ``"random"``.
        pad_token_id: pads prompts and responses; None = ``model.config.pad_token_id`` or 0.
        mask_token_id: None = ``model.config.mask_token_id``.
    """

    PRECISIONS: ClassVar[tuple[str, ...]] = DIFFUSION_PRECISIONS
    """Precisions this engine runs."""
    TRAINER_PRECISION_COPY: ClassVar[dict[str, Any] | None] = {"precision": "fp32", "backend": None}
    """Arguments that turn this engine into a plain fp32 copy of itself (same sampler settings), for the
    validation accuracy at the trainer's precision (as ``TorchRolloutEngine.TRAINER_PRECISION_COPY``)."""
    MODEL_FAMILY: ClassVar[str] = "masked_diffusion"
    """The model family it samples; a config may pair it only with a policy of the same ``MODEL_FAMILY``."""

    @classmethod
    def support_replay_gap(cls, top_k: int, top_p: float, min_p: float) -> str | None:
        """None: the kept set each token was drawn from at its unmasking step is recorded (``RolloutBatch.support``)."""
        return None

    def __init__(
        self,
        model: nn.Module,
        precision: str = "fp32",
        backend: str | None = None,
        steps: int | None = None,
        block_length: int | None = None,
        remasking: str = "low_confidence",
        pad_token_id: int | None = None,
        mask_token_id: int | None = None,
    ) -> None:
        args = DiffusionRolloutEngine.check_args(
            precision=precision,
            backend=backend,
            steps=steps,
            block_length=block_length,
            remasking=remasking,
            pad_token_id=pad_token_id,
            mask_token_id=mask_token_id,
        )
        if not callable(getattr(model, "get_decoder", None)) or not callable(
            getattr(model, "get_output_embeddings", None)
        ):
            raise ValueError(
                f"model must provide get_decoder() and get_output_embeddings() (a mask predictor such as "
                f"TinyDiffusionLM), got {type(model).__name__}"
            )
        self.precision: str = args["precision"]
        self.backend: str | None = args["backend"]
        self.steps: int | None = args["steps"]
        self.block_length: int | None = args["block_length"]
        self.remasking: str = args["remasking"]
        config = getattr(model, "config", None)
        mask_id = (
            args["mask_token_id"] if mask_token_id is not None else getattr(config, "mask_token_id", None)
        )
        if mask_id is None:
            raise ValueError("mask_token_id is None and model.config has no mask_token_id")
        pad_id = args["pad_token_id"] if pad_token_id is not None else getattr(config, "pad_token_id", None)
        self.mask_token_id = int(mask_id)
        self.pad_token_id = int(pad_id) if pad_id is not None else 0

        self.model = copy.deepcopy(model).eval()
        self.model.requires_grad_(False)
        self._prepare_model()
        self.body = self.model.get_decoder()
        self.head = self.model.get_output_embeddings()
        self.vocab_size = int(self.head.weight.shape[0])
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )

    @classmethod
    def check_args(cls, **kwargs: Any) -> dict[str, Any]:
        """Validate constructor arguments (all but ``model``) without building anything.

        Unknown names and values outside what the engine runs raise ValueError naming the argument and
        what it accepts. Returns every argument with the constructor's defaults filled in (taken from
        its signature, so they live in one place) and ``backend`` None resolved to the precision's default.
        """
        name = cls.__name__
        params = {
            p.name: p.default
            for p in inspect.signature(cls.__init__).parameters.values()
            if p.name not in ("self", "model")
        }
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ValueError(f"{name} got unknown argument(s) {unknown}; it accepts {sorted(params)}")
        args = {**params, **kwargs}
        precision, backend = args["precision"], args["backend"]
        if precision not in DIFFUSION_PRECISIONS:
            raise ValueError(
                f"{name}: precision={precision!r} is not supported; precision must be one of {list(DIFFUSION_PRECISIONS)}"
            )
        if backend is not None:
            if precision not in _DEFAULT_BACKEND:
                raise ValueError(
                    f"{name}: backend={backend!r} is only used with precision in {sorted(_DEFAULT_BACKEND)}, "
                    f"got precision={precision!r}; use backend=None"
                )
            if backend not in QUANT_BACKENDS:
                raise ValueError(
                    f"{name}: backend={backend!r} is not supported; backend must be one of {list(QUANT_BACKENDS)}"
                )
            if backend in INTEGER_BACKENDS and precision != "int8":
                raise ValueError(
                    f"{name}: backend={backend!r} (integer GEMM) only runs precision='int8', got precision={precision!r}"
                )
        if backend is None:
            backend = default_int8_backend() if precision == "int8" else _DEFAULT_BACKEND.get(precision)
        args["backend"] = backend
        for arg in ("steps", "block_length"):
            if args[arg] is not None and not _is_int(args[arg], 1):
                raise ValueError(f"{name}: {arg} must be None or an int >= 1, got {args[arg]!r}")
        if args["remasking"] not in REMASKING:
            raise ValueError(
                f"{name}: remasking={args['remasking']!r} is not supported; remasking must be one of {list(REMASKING)}"
            )
        for arg in ("pad_token_id", "mask_token_id"):
            if args[arg] is not None and not _is_int(args[arg], 0):
                raise ValueError(f"{name}: {arg} must be None or an int >= 0, got {args[arg]!r}")
        return args

    # ------------------------------------------------------------------ setup
    def _prepare_model(self) -> None:
        """Cast or quantize the private copy in place (exactly as ``TorchRolloutEngine._prepare_model``)."""
        if self.precision == "bf16":
            self.model.to(torch.bfloat16)
        elif self.precision in _DEFAULT_BACKEND:
            from ais_lightning.quant import get_recipe, quantize_model

            quantize_model(self.model, get_recipe(self.precision), backend=self.backend)

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    # ------------------------------------------------------------- weight sync
    def _sync_targets(self) -> dict[str, torch.Tensor]:
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        return targets

    @torch.no_grad()
    @without_autocast
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's weights and buffers, all or nothing, then re-quantize.

        ``named_tensors``: ``(name, tensor)`` pairs named as the model's ``state_dict`` / buffers (e.g.
        ``DiffusionPolicy.full_state_dict()``). The WHOLE sync is checked before anything is written: every
        name must be a parameter or buffer of the engine's model (all unknown names are listed), every shape
        must match, every floating value must be finite once cast to the engine's dtype. A rejected sync
        raises ValueError and leaves the engine exactly as it was. Names not sent keep their value.
        """
        incoming = list(check_named_tensors(named_tensors))
        targets = self._sync_targets()
        unknown = sorted({n for n, _ in incoming} - set(targets))
        if unknown:
            raise ValueError(
                f"sync_weights got {len(unknown)} names the engine's model does not have: {unknown}"
            )
        pairs = []
        for name, value in incoming:
            target = targets[name]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"sync_weights: {name} must be a torch.Tensor, got {type(value).__name__}")
            if value.shape != target.shape:
                raise ValueError(
                    f"sync_weights: {name} has shape {tuple(value.shape)}, the engine's model has {tuple(target.shape)}"
                )
            if target.is_floating_point() and not bool(torch.isfinite(value.detach().to(target.dtype)).all()):
                raise ValueError(
                    f"sync_weights: {name} has non-finite values as {target.dtype}; the sync was rejected and "
                    "the engine keeps its previous weights"
                )
            pairs.append((target, value))
        for target, value in pairs:
            target.copy_(value.detach().to(device=target.device, dtype=target.dtype))
        from ais_lightning.quant import refresh_quantized

        refresh_quantized(self.model)  # no QuantLinear at fp32/bf16

    # --------------------------------------------------------------- generate
    def _check_prompts(self, prompts: list[list[int]], sampling: SamplingConfig | None = None) -> None:
        """The engines' shared checks (token ids, ``sampling``, prompt + canvas within the model's context),
        and no mask token in a prompt."""
        if sampling is None:
            check_prompts(prompts, self.vocab_size)
        else:
            check_generate_args(prompts, sampling, self.vocab_size, context_length(self.model))
        for i, p in enumerate(prompts):
            if self.mask_token_id in p:
                raise ValueError(f"prompts[{i}] contains the mask token id {self.mask_token_id}")

    def schedule(self, length: int) -> list[DenoisingStep]:
        """The denoising steps of a ``length``-token response with this engine's settings."""
        return denoising_schedule(length, self.steps, self.block_length)

    @torch.inference_mode()
    @without_autocast
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Sample ``sampling.n`` responses of ``sampling.max_new_tokens`` positions per prompt (rows of one
        prompt contiguous); ``sampling.seed`` makes the draw reproducible. A caller's ``torch.autocast`` is
        turned off inside (and in :meth:`sync_weights`): the engine computes in its own precision."""
        self._check_prompts(prompts, sampling)
        dev, n, length = self.device, sampling.n, sampling.max_new_tokens
        gen = make_generator(sampling.seed, dev)
        prompt_ids, prompt_mask = pad_sequences(
            [list(p) for p in prompts], self.pad_token_id, "left"
        )  # [Bp, P]
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0).to(dev)  # [B, P]
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0).to(dev)  # [B, P]
        batch, plen = prompt_ids.shape

        canvas = torch.full((batch, length), self.mask_token_id, dtype=torch.long, device=dev)  # [B, T]
        unmask_step = torch.full((batch, length), -1, dtype=torch.long, device=dev)  # [B, T]
        logprobs = torch.zeros((batch, length), dtype=torch.float32, device=dev)  # [B, T]
        attention = torch.cat([prompt_mask, torch.ones_like(canvas, dtype=torch.bool)], dim=1)  # [B, P+T]
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)  # [B, P+T]
        rows = torch.arange(batch, device=dev)[:, None]  # [B, 1]
        kept_sets = SupportRecorder() if sampling.records_support(self.vocab_size) else None
        for s, step in enumerate(self.schedule(length)):
            b0, b1, k = step.block_start, step.block_end, step.num_unmask
            hidden = self.body(torch.cat([prompt_ids, canvas], dim=1), attention, positions)  # [B, P+T, H]
            still = unmask_step[:, b0:b1] < 0  # [B, W]; the same count m in every row
            m = int(still[0].sum())
            cand_logits = self.head(hidden[:, plen + b0 : plen + b1][still]).float()  # [B*m, V]
            draw = draw_next(
                cand_logits, sampling.temperature, sampling.top_k, sampling.top_p, gen, min_p=sampling.min_p
            )
            tokens, token_lp = draw.tokens, draw.logprobs  # [B*m]
            if self.remasking == "low_confidence":  # LLaDA: probability under softmax(logits), temperature 1
                score = logprobs_from_logits(cand_logits, tokens, 1.0)  # [B*m] (log is monotone)
            else:
                score = torch.rand(tokens.shape, generator=gen, device=dev)  # [B*m]
            keep = score.view(batch, m).topk(k, dim=-1).indices  # [B, k] among the still-masked slots
            slots = still.nonzero()[:, 1].view(batch, m)  # [B, m] block offsets of the still-masked slots
            cols = b0 + slots.gather(1, keep)  # [B, k] response positions unmasked now
            canvas[rows, cols] = tokens.view(batch, m).gather(1, keep)
            logprobs[rows, cols] = token_lp.view(batch, m).gather(1, keep)
            unmask_step[rows, cols] = s
            if (
                kept_sets is not None and draw.kept is not None
            ):  # the sets the unmasked tokens were drawn from
                chosen = (rows * m + keep).reshape(-1)  # [B*k] their candidates
                kept_sets.add(rows.expand(-1, k).reshape(-1), cols.reshape(-1), draw.kept[chosen])

        mask, stopped = response_end_mask(canvas, sampling.stop_token_ids)  # [B, T], [B]
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=torch.where(mask, canvas, self.pad_token_id),
            response_mask=mask,
            rollout_logprobs=torch.where(mask, logprobs, 0.0),
            finish_reason=["stop" if s else "length" for s in stopped.tolist()],
            prompt_index=torch.arange(len(prompts), device=dev).repeat_interleave(n),
            extras={"unmask_step": unmask_step, "canvas_ids": canvas, "canvas_logprobs": logprobs},
            support=kept_sets.build(mask) if kept_sets is not None else None,
        )
