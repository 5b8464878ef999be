"""The RolloutEngine contract (docs/design.md section 3).

An engine wraps a Hugging Face causal LM, generates responses to token-id prompts with
sampling, and returns the log-prob of each sampled token under its *own* (possibly
low-precision) forward, after temperature. ``sync_weights`` is called after every optimizer
step with the trainer's full (unsharded) weights and buffers. Every other capability the
training loop and ``ais-train`` use is declared, with its default, on :class:`RolloutEngine`.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from ais_lightning.ops import take_rows
from ais_lightning.rollout.sampling import truncates
from ais_lightning.rollout.support import SamplingSupport

_F = TypeVar("_F", bound=Callable[..., Any])


@contextlib.contextmanager
def autocast_disabled() -> Iterator[None]:
    """Turn off a caller's ``torch.autocast`` (CPU and CUDA) for the block; restored on exit.

    An engine computes in its own precision: Lightning's precision plugin (``precision=bf16-mixed``) wraps
    ``training_step`` / ``validation_step`` in autocast, and the GRPO module calls the engines from there, so
    without this an fp32 engine (the rollout policy mu, or the trainer-precision copy) would compute in bf16.
    """
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if (device == "cpu" or torch.cuda.is_available()) and torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def without_autocast(method: _F) -> _F:
    """Decorator: run ``method`` under :func:`autocast_disabled` (engines' ``generate`` and ``sync_weights``)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with autocast_disabled():
            return method(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@dataclass
class SamplingConfig:
    """How to sample. Mirrors vLLM's ``SamplingParams`` names."""

    n: int = 1
    """Responses per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (log-probs are then those of the T=1 distribution)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 = off. Like top_k and min_p it renormalizes mu over the tokens it keeps: an engine
    that records them (``record_support``) lets the trainer renormalize pi over the same set."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    min_p: float = 0.0
    """Keep the tokens whose probability is at least ``min_p`` times the most likely one's (vLLM's ``min_p``);
    0 = off. Applied before top-k and top-p, as in vLLM."""
    max_new_tokens: int = 32
    """Upper bound on response length."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end a response (included in the response, last valid token)."""
    seed: int | None = None
    """Seed for reproducible sampling; None draws from the global generator."""
    record_support: bool = True
    """With truncation on (min_p, top_k or top_p) and T > 0, record the tokens it kept at every sampled position
    (``RolloutBatch.support``), which the policy replays (:mod:`ais_lightning.rollout.support`); engines that
    cannot record it say so (:meth:`RolloutEngine.support_replay_gap`)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n must be >= 1, got {self.n}")
        if not 0 <= self.temperature < math.inf:  # also rejects NaN
            raise ValueError(
                f"SamplingConfig.temperature must be a finite number >= 0, got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:  # also rejects NaN
            raise ValueError(f"SamplingConfig.min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.record_support, bool):
            raise ValueError(
                f"SamplingConfig.record_support must be True or False, got {self.record_support!r}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.stop_token_ids = list(self.stop_token_ids)

    def records_support(self, vocab_size: int) -> bool:
        """Whether ``generate`` records the kept sets: ``record_support`` asks for them, T > 0, and the truncation
        drops tokens of a ``vocab_size``-token distribution (the engines' one condition)."""
        return (
            self.record_support
            and self.temperature > 0
            and truncates(vocab_size, self.top_k, self.top_p, self.min_p)
        )


@dataclass
class RolloutBatch:
    """Generated responses, one row per (prompt, sample); rows of one prompt are contiguous.

    ``prompt_ids``: ``[B, P]`` long, left-padded with ``pad_token_id`` (``prompt_mask`` True on real tokens).
    ``response_ids``: ``[B, T]`` long, right-padded.
    ``response_mask``: ``[B, T]`` bool, True on generated tokens up to and including a stop token.
    ``rollout_logprobs``: ``[B, T]`` float32, log mu of each sampled token (0 where masked).
    ``finish_reason``: ``B`` strings, ``"stop"`` or ``"length"``.
    ``prompt_index``: ``[B]`` long, which input prompt each row answers.
    ``extras``: per-row tensors (first dim ``B``) that a model family needs to score its own samples,
    e.g. the denoising step at which a masked-diffusion sampler unmasked each response token; empty
    for autoregressive engines.
    ``routing``: ``[B, P + T, L, k]`` uint8/int16 (``ais_lightning.models.routing``), the expert ids the engine's
    top-k routers picked at each position of the (prompt | response) sequence in each of its ``L``
    mixture-of-experts layers, for rollout routing replay (``policy.router_replay``); only the positions of
    ``routing_replay_mask(prompt_mask, response_mask)`` are meaningful. None for dense models and engines that
    do not record routing.
    ``support``: the tokens the engine's min-p / top-k / top-p truncation kept at each response position
    (:class:`~ais_lightning.rollout.support.SamplingSupport`), which the policy renormalizes pi over
    (``Policy.batch_logprobs``); None when nothing was truncated, the draw was greedy, or the engine records none.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    finish_reason: list[str]
    prompt_index: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    routing: torch.Tensor | None = None
    support: SamplingSupport | None = None

    def rows(self, index: torch.Tensor) -> RolloutBatch:
        """The rows ``index`` (``[R]`` long) of every field."""
        return take_rows(self, index)

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())


class RolloutEngine(abc.ABC):
    """The base of every rollout engine: what ``GRPOModule`` and ``ais-train`` use, each with its default.

    A subclass implements :meth:`generate` and :meth:`sync_weights` and overrides what it supports. The class
    attributes and classmethods are read before any engine exists (``ais-train`` checks a config with them);
    nothing else of an engine is looked up by name.

    Declared capabilities (defaults in brackets):

    - :attr:`PRECISIONS` [``()``]: the ``precision`` values the constructor accepts.
    - :attr:`TRAINER_PRECISION_COPY` [None]: constructor arguments that turn the engine into a copy of itself at
      the trainer's precision (fp32), which measures validation accuracy at that precision; None: no such copy.
    - :attr:`MODEL_FAMILY` [``"autoregressive"``]: the family of models it samples (a policy of another family
      is refused).
    - :attr:`RECORDS_ROUTING` [False]: it records mixture-of-experts routing (``RolloutBatch.routing``), which
      ``policy.router_replay`` replays.
    - :attr:`SUPPORTS_SET_PRECISION` [False]: :meth:`set_precision` switches the precision in place (a
      progressive ``policy.aligned_schedule`` needs it).
    - :attr:`RESERVES_TRAINER_MEMORY` [False]: the engine claims a share of the device memory free when it starts,
      and its constructor takes ``reserve_bytes``, the memory to leave for what the trainer allocates later.
    - :meth:`support_replay_gap` [the engine records no support]: why ``generate`` cannot record the exact set a
      truncation keeps (``RolloutBatch.support``), or None when it can; ``ais-train`` refuses a corrector with
      truncation where it cannot.
    - :meth:`check_args` [returns the arguments as given] and :meth:`check_model` [checks nothing]: validation
      before any engine is built, from the constructor's arguments and from the model.
    - :attr:`precision` [None: not declared] and :attr:`model_impl` [None]: what a built engine runs, for the
      run's summary and the precision schedule.
    - :meth:`calibration_state` [None] / :meth:`load_calibration_state` [refuses anything but None]: the engine's
      own state beyond its weights, kept in checkpoints.
    - :meth:`close` [nothing to release]: frees what the engine holds (device memory) at the end of a run.

    Example:
        >>> import torch
        >>> from ais_lightning.rollout import RolloutBatch, RolloutEngine, SamplingConfig
        >>> class Echo(RolloutEngine):
        ...     "Answers every prompt with its last token, with probability 1."
        ...     precision = "fp32"
        ...     def sync_weights(self, named_tensors):
        ...         pass  # no weights
        ...     def generate(self, prompts, sampling):
        ...         rows = [p for p in prompts for _ in range(sampling.n)]
        ...         return RolloutBatch(
        ...             prompt_ids=torch.tensor(rows), prompt_mask=torch.ones(len(rows), len(rows[0]), dtype=torch.bool),
        ...             response_ids=torch.tensor([[r[-1]] for r in rows]), response_mask=torch.ones(len(rows), 1, dtype=torch.bool),
        ...             rollout_logprobs=torch.zeros(len(rows), 1), finish_reason=["length"] * len(rows),
        ...             prompt_index=torch.arange(len(prompts)).repeat_interleave(sampling.n),
        ...         )
        >>> engine = Echo()
        >>> engine.generate([[5, 7]], SamplingConfig(n=2)).response_ids.tolist()
        [[7], [7]]
        >>> Echo.check_args(precision="fp32"), Echo.TRAINER_PRECISION_COPY, Echo.MODEL_FAMILY
        ({'precision': 'fp32'}, None, 'autoregressive')
        >>> engine.SUPPORTS_SET_PRECISION, engine.calibration_state()
        (False, None)
        >>> engine.set_precision("int8")
        Traceback (most recent call last):
        ...
        NotImplementedError: Echo cannot switch its precision in place (SUPPORTS_SET_PRECISION is False): build a new engine at precision 'int8'
    """

    PRECISIONS: ClassVar[tuple[str, ...]] = ()
    """The ``precision`` values the constructor accepts (``ais_lightning.rollout.engine_precisions``); empty: the
    engine declares none."""
    TRAINER_PRECISION_COPY: ClassVar[dict[str, Any] | None] = None
    """Constructor arguments that make a plain fp32 copy of the engine (the trainer's precision), merged over the
    engine's own: validation measures accuracy with it beside the engine's. None: no such copy."""
    MODEL_FAMILY: ClassVar[str] = "autoregressive"
    """The family of models it samples; a run pairs it only with a policy of the same ``MODEL_FAMILY``."""
    RECORDS_ROUTING: ClassVar[bool] = False
    """Whether ``generate`` records mixture-of-experts routing (``RolloutBatch.routing``) for
    ``policy.router_replay``."""
    SUPPORTS_SET_PRECISION: ClassVar[bool] = False
    """Whether :meth:`set_precision` switches the precision in place (a subclass that sets it overrides the
    method)."""
    RESERVES_TRAINER_MEMORY: ClassVar[bool] = False
    """Whether the engine takes a share of the device memory free when it starts (vLLM) and its constructor accepts
    ``reserve_bytes``: device memory to leave free for what the trainer allocates after the engine starts (its
    gradients and optimizer states; ``GRPOModule`` adds them, ``ais_lightning.modules.trainer_memory``)."""

    precision: str | None = None
    """The precision the engine runs (one of :attr:`PRECISIONS`); None: not declared."""
    model_impl: str | None = None
    """The forward the engine runs, when it has a choice (the torch engine: ``"lean"`` or ``"transformers"``);
    None otherwise."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.SUPPORTS_SET_PRECISION and cls.set_precision is RolloutEngine.set_precision:
            raise TypeError(
                f"{cls.__name__} declares SUPPORTS_SET_PRECISION but does not override set_precision"
            )

    @abc.abstractmethod
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's full weights and buffers (re-quantizing where the engine quantizes)."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Sample ``sampling.n`` responses per prompt (rows of one prompt contiguous), with the log-prob of every
        sampled token under the engine's own forward, after temperature."""

    @classmethod
    def support_replay_gap(cls, top_k: int, top_p: float, min_p: float) -> str | None:
        """Why ``generate`` cannot record the exact set of tokens this truncation keeps (``RolloutBatch.support``,
        replayed by the policy so that pi / mu is exact), or None when it records it. Default: the engine records
        none."""
        return f"{cls.__name__} does not record the tokens its truncation keeps (RolloutBatch.support)"

    @classmethod
    def check_args(cls, **kwargs: Any) -> dict[str, Any]:
        """Validate constructor arguments (all but ``model``) without building anything: ValueError naming the
        argument. Returns them with the constructor's defaults filled in and normalized (compared to tell whether
        two configurations build the same engine). Default: the arguments as given, unchecked."""
        return dict(kwargs)

    @classmethod
    def check_model(cls, model: Any, **arguments: Any) -> Any:
        """Check what depends on ``model`` itself, with the constructor's other ``arguments``, without copying the
        model (``ais-train`` runs it on the initial policy before its warm start): ValueError saying why the engine
        cannot run it. Default: nothing to check."""
        return None

    def set_precision(self, precision: str) -> None:
        """Switch to another precision in place, as if built at ``precision`` from the current weights (only when
        :attr:`SUPPORTS_SET_PRECISION`). Default: NotImplementedError."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot switch its precision in place (SUPPORTS_SET_PRECISION is False): build a "
            f"new engine at precision {precision!r}"
        )

    def calibration_state(self) -> Any:
        """The engine's own state beyond the weights a sync delivers (e.g. calibrated outlier channels), which a
        checkpoint keeps so that a resumed run samples as the uninterrupted one; None: nothing to keep (default)."""
        return None

    def load_calibration_state(self, state: Any) -> None:
        """Restore :meth:`calibration_state` (after the weights are synced); ValueError for a state that does not fit
        this engine, leaving it as it was. Default: only None (nothing) fits."""
        if state is not None:
            raise ValueError(
                f"{type(self).__name__} keeps no calibration state, got a {type(state).__name__} (taken from another "
                "engine)"
            )

    def close(self) -> None:  # noqa: B027 - a default (nothing to release), not an abstract method
        """Release what the engine holds (e.g. vLLM's device memory); it cannot sample afterwards. Default: nothing
        to release."""
