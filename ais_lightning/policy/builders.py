"""Policy options of ``ais-train`` (``conf/policy``): small specs that validate now and build later.

Instantiating a spec is cheap and checks its arguments (config time, before anything heavy);
``spec.build(seed)`` makes the :class:`~ais_lightning.policy.Policy` with its tokenizer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ais_lightning.policy.policy import Policy, check_aligned_quantization

DTYPES = ("float32", "bfloat16")
"""Trainer precisions: float32 (the CPU default: bf16 is ~5x slower on CPUs without native bf16) or bfloat16."""


def _check_common(dtype: str, logprob_chunk_size: int, aligned_quantization: str | None) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if isinstance(logprob_chunk_size, bool) or not isinstance(logprob_chunk_size, int) or logprob_chunk_size < 1:
        raise ValueError(f"logprob_chunk_size must be an int >= 1, got {logprob_chunk_size!r}")
    if aligned_quantization is not None:
        check_aligned_quantization(aligned_quantization)


@dataclass
class TinyQwen3:
    """The built-in ~0.8M-parameter Qwen3 with the character tokenizer (built locally, nothing downloaded)."""

    dtype: str = "float32"
    """Trainer precision: float32 or bfloat16."""
    logprob_chunk_size: int = 1024
    """Response positions per chunk when computing log-probs/entropy (bounds the [chunk, V] logits)."""
    aligned_quantization: str | None = None
    """QaRL: an ``ais_lightning.quant`` recipe the trainer's forward runs through (None = off)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """``Qwen3Config`` overrides of the tiny model, e.g. ``{num_hidden_layers: 2}``."""

    def __post_init__(self) -> None:
        _check_common(self.dtype, self.logprob_chunk_size, self.aligned_quantization)
        from ais_lightning.models import tiny_qwen3_config

        try:
            tiny_qwen3_config(**dict(self.overrides))
        except (TypeError, ValueError) as err:
            raise ValueError(f"overrides do not make a valid tiny Qwen3 config: {err}") from err

    def build(self, seed: int = 0) -> Policy:
        """The policy, its weights initialized from ``seed``."""
        from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3

        model = build_tiny_qwen3(seed=seed, **dict(self.overrides)).to(getattr(torch, self.dtype))
        return Policy(model, build_char_tokenizer(), self.logprob_chunk_size, self.aligned_quantization)


@dataclass
class Pretrained:
    """Any Hugging Face causal LM from a local directory (weights and tokenizer; never the hub)."""

    path: str
    """Local directory of the model (``config.json``, weights, tokenizer files)."""
    dtype: str = "float32"
    """Trainer precision: float32 or bfloat16."""
    logprob_chunk_size: int = 1024
    """Response positions per chunk when computing log-probs/entropy (bounds the [chunk, V] logits)."""
    aligned_quantization: str | None = None
    """QaRL: an ``ais_lightning.quant`` recipe the trainer's forward runs through (None = off)."""

    def __post_init__(self) -> None:
        if not self.path or not os.path.isdir(self.path):
            raise ValueError(f"path must name a local model directory, got {self.path!r}")
        _check_common(self.dtype, self.logprob_chunk_size, self.aligned_quantization)

    def build(self, seed: int = 0) -> Policy:
        """The policy (``seed`` is unused: the weights come from the directory)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return Policy.from_pretrained(
            self.path,
            dtype=getattr(torch, self.dtype),
            tokenizer=tokenizer,
            logprob_chunk_size=self.logprob_chunk_size,
            aligned_quantization=self.aligned_quantization,
        )


def _policies() -> dict[str, type]:
    from ais_lightning.policy.diffusion import TinyLLaDA

    return {"tiny_qwen3": TinyQwen3, "local": Pretrained, "tiny_llada": TinyLLaDA}


POLICIES: dict[str, type] = _policies()
"""Config names of the built-in policy options (``conf/policy``)."""
