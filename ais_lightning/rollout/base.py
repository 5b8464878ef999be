"""The RolloutEngine contract (docs/design.md section 3).

An engine wraps a Hugging Face causal LM, generates responses to token-id prompts with
sampling, and returns the log-prob of each sampled token under its *own* (possibly
low-precision) forward, after temperature. ``sync_weights`` is called after every optimizer
step with the trainer's full (unsharded) weights and buffers.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from ais_lightning.ops import take_rows

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
    """Nucleus sampling mass; 1.0 = off. It changes mu: keep it off with a corrector on."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off. It changes mu like top_p."""
    max_new_tokens: int = 32
    """Upper bound on response length."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end a response (included in the response, last valid token)."""
    seed: int | None = None
    """Seed for reproducible sampling; None draws from the global generator."""

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
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.stop_token_ids = list(self.stop_token_ids)


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

    def rows(self, index: torch.Tensor) -> RolloutBatch:
        """The rows ``index`` (``[R]`` long) of every field."""
        return take_rows(self, index)

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from an engine."""

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's full weights and buffers (re-quantizing where the engine quantizes)."""
        ...

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Sample ``sampling.n`` responses per prompt."""
        ...
