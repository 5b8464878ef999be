"""The warm start's cache key: everything the warm-started weights depend on, hashed.

The model class, config, attention implementation and *initial weights* (their SHA-256), the tokenizer, the
task class and every dataclass field, every setting, the seed, the thread count, torch and transformers
versions, the CPU capability and architecture (:func:`cache_key_payload`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
from typing import Any

import torch

from ais_lightning.app.warmstart.settings import WarmStartSettings
from ais_lightning.policy import Policy
from ais_lightning.tasks import Task

__all__ = [
    "CACHE_VERSION",
    "cache_key",
    "cache_key_payload",
    "state_dict_sha256",
    "task_fingerprint",
    "tokenizer_fingerprint",
]

CACHE_VERSION = 2
"""Bumped when the procedure or the entry layout changes (every older entry then misses)."""


def state_dict_sha256(module: torch.nn.Module) -> str:
    """SHA-256 of a module's state dict: every entry's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """What identifies a tokenizer's encoding: class, vocabulary hash and special-token ids."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    blob = json.dumps(sorted(vocab.items()), default=str).encode()
    return {
        "class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
        "vocab_sha256": hashlib.sha256(blob).hexdigest(),
        "size": len(tokenizer) if hasattr(tokenizer, "__len__") else len(vocab),
        "special": {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }


def task_fingerprint(task: Task) -> dict[str, Any]:
    """The task's class and every dataclass field (loaded data included, e.g. GSM8K's rows)."""
    if not (isinstance(task, Task) and dataclasses.is_dataclass(task)):
        raise ValueError(
            f"task must be an ais_lightning.tasks.Task dataclass instance, got {type(task).__qualname__}"
        )
    return {"class": f"{type(task).__module__}.{type(task).__qualname__}", "fields": dataclasses.asdict(task)}


def cache_key_payload(
    policy: Policy, tokenizer: Any, task: Task, settings: WarmStartSettings, seed: int, num_threads: int
) -> dict[str, Any]:
    """Everything the warm-started weights depend on (JSON-serializable with ``default=str``)."""
    import transformers

    config = policy.model.config
    return {
        "version": CACHE_VERSION,
        "model": {
            "class": f"{type(policy.model).__module__}.{type(policy.model).__qualname__}",
            "config": {k: v for k, v in sorted(config.to_dict().items()) if not k.startswith("_")},
            "attn_implementation": getattr(config, "_attn_implementation", None),
            "initial_weights_sha256": state_dict_sha256(policy.model),
        },
        "tokenizer": tokenizer_fingerprint(tokenizer),
        **({"chat_template": tokenizer.chat_template} if policy.chat_template else {}),  # the prompts' format
        **({"head_dtype": "float32"} if policy.head_float32 else {}),  # the head's precision
        "task": task_fingerprint(task),
        "settings": settings.key_fields(),
        "seed": seed,
        "num_threads": num_threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
    }


def cache_key(payload: dict[str, Any]) -> str:
    """A short, stable hash of :func:`cache_key_payload`."""
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]
