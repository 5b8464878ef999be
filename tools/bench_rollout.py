"""Rollout throughput benchmark: one run, same model and prompts for every engine.

Engines: HF ``model.generate`` (fp32, and on an fbgemm int8 copy), ``TorchRolloutEngine`` at
fp32/bf16/fp8/fp4/int8 on its lean forward (``torch-*``) and through the model's own Hugging Face forward
(``torch_hf-*``, ``model_impl="transformers"``: what every model outside the lean families runs), and
vLLM when importable. For each: tokens/s, ms per decode step, memory,
the ratio to torch-fp32, and the fraction of a GEMM roofline: 2 x (linear-layer params) FLOP per
token at the fp32 / int8 GEMM rates this run measures at the decode shape (M = batch).

Memory: ``weights MB`` = bytes of the engine model's unique parameters and buffers (cached
fake-quantized weights included; fbgemm packed int8 weights counted as 1 byte per weight);
``run MB`` = peak growth of the resident set size (RSS, /proc/self/statm, sampled every 2 ms by a
thread) during the warm-up ``generate`` over the RSS before it (KV cache + activations). RSS only grows
when the allocator needs new pages, so ``run MB`` under-counts memory reused from earlier engines.

Each engine is built once and warmed up by one full-length ``generate`` (its buffers allocated and
touched, as in an RL loop that rolls out every step; memory is sampled then), and the timed runs
reuse it with no sampling thread competing for the cores. vLLM (one ``LLM`` per process at a time)
is rebuilt and warmed up every repeat.

``--repeats R`` runs the engines round-robin R times. tokens/s, ms/step and roofline come
from each engine's best time (best-of-R is the least noisy estimate of what the code can do); the
"vs" ratios are *paired*: the median over repeats of the ratio of the two engines' times within the
same repeat, where they ran back to back under the same machine load (on a shared machine the load
drifts between repeats by more than the differences being measured), followed by the range of the
per-repeat ratios (all of them are in the JSON). With R = 1 both agree.

    python tools/bench_rollout.py --config tiny --out bench_tiny.json
    python tools/bench_rollout.py --config gemm --out bench_gemm.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ais_lightning.measure import PeakRSS
from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
from ais_lightning.rollout.prompts import left_pad


@dataclass
class BenchConfig:
    """One benchmark shape."""

    batch: int
    """Prompts per generate call (n = 1)."""
    prompt_len: tuple[int, int]
    """Prompt lengths are drawn uniformly from this inclusive range."""
    new_tokens: int
    """Tokens generated per prompt (no stop tokens: every row runs to the end)."""
    model: dict
    """Qwen3Config overrides; empty = the built-in tiny model."""


CONFIGS = {
    "tiny": BenchConfig(batch=128, prompt_len=(8, 16), new_tokens=32, model={}),
    "gemm": BenchConfig(
        batch=64,
        prompt_len=(16, 16),
        new_tokens=64,
        model=dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=4096,
            tie_word_embeddings=False,
        ),
    ),
}
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


def build_model(cfg: BenchConfig) -> nn.Module:
    from ais_lightning.models import build_tiny_qwen3

    return build_tiny_qwen3(seed=0, attn_implementation="sdpa", **cfg.model).eval()


def make_prompts(cfg: BenchConfig, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lo, hi = cfg.prompt_len
    lengths = torch.randint(lo, hi + 1, (cfg.batch,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def linear_params(model: nn.Module) -> int:
    """Parameters that go through a GEMM per token (all linear layers, lm_head included)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the unique tensors (parameters + buffers, e.g. cached fake-quantized weights) of ``model``.

    fbgemm's packed int8 weights are opaque objects and are counted from their shape (1 byte/weight).
    """
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    packed = [m for m in model.modules() if getattr(m, "_packed", None) is not None]
    return total + sum(m.weight.numel() for m in packed)


def gemm_rates(m: int, k: int, n: int, seconds: float = 1.0) -> dict[str, float]:
    """FLOP/s of an fp32 ``[m,k] @ [k,n]`` and of an fbgemm dynamic int8 linear of the same shape."""
    from ais_lightning.quant.linear import _quantized_engine_reduce_range, int8_prepack

    x, w = torch.randn(m, k), torch.randn(n, k) / k**0.5
    packed = int8_prepack(w, None)
    rr = _quantized_engine_reduce_range()
    ops = {
        "fp32": lambda: torch.nn.functional.linear(x, w),
        "int8": lambda: torch.ops.quantized.linear_dynamic(x, packed, rr),
    }
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


@dataclass
class Prepared:
    """An engine built and warmed up: ``run()`` does one timed-size ``generate``; ``close()``, if any, frees it."""

    run: Callable[[], None]
    weight_bytes: int  # -1 when not measurable (vLLM owns its weights)
    run_peak_bytes: int  # peak RSS growth during the full-length warm-up generate
    close: Callable[[], None] | None = None  # only vLLM holds resources beyond Python objects


def prepare(name: str, model: nn.Module, prompts: list[list[int]], new: int) -> Prepared:
    """Build engine ``name`` (``hf-fp32``, ``torch-int8``, ``torch_hf-int8``, ``vllm-bf16``, ...) and warm it up.

    The warm-up is one full-length ``generate`` (every buffer the timed runs need is allocated and
    touched, as in an RL loop where the engine rolls out every step), and the peak RSS is sampled
    during it, so the timed runs have no sampling thread competing for the cores.
    Raises ImportError / ValueError when the engine cannot run here.
    """
    kind, _, precision = name.partition("-")
    close = None
    if kind == "hf":
        if precision == "int8":
            from ais_lightning.quant import get_recipe, quantize_model

            model = quantize_model(copy.deepcopy(model), get_recipe("int8"), backend="int8")
        ids, mask = left_pad(prompts, 0)
        kwargs = dict(
            input_ids=ids,
            attention_mask=mask.long(),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            pad_token_id=0,
        )

        @torch.inference_mode()
        def run() -> None:
            model.generate(**kwargs, max_new_tokens=new, min_new_tokens=new)

        weights = weight_bytes(model)
    else:
        if kind in ("torch", "torch_hf"):
            impl = "transformers" if kind == "torch_hf" else "lean"
            engine = TorchRolloutEngine(model, precision=precision, model_impl=impl)
            weights = weight_bytes(engine.model)
        else:
            from ais_lightning.rollout.factory import build_engine

            engine = build_engine("vllm", model, precision=precision)
            weights, close = -1, engine.close

        def run() -> None:
            batch = engine.generate(prompts, SamplingConfig(max_new_tokens=new, seed=0))
            assert batch.num_tokens == len(prompts) * new, "the benchmark needs every row to run to the end"

    with PeakRSS() as warm_mem:
        run()
    return Prepared(run, weights, warm_mem.peak_delta, close)


def timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def paired_ratios(ref_seconds: list[float], seconds: list[float]) -> list[float]:
    """``ref_seconds[r] / seconds[r]`` per repeat: how many times faster than the reference, run by run.

    Both lists hold one time per round-robin repeat, so each ratio compares two runs made back to back.
    """
    if len(ref_seconds) != len(seconds) or not seconds:
        raise ValueError(
            f"need one time per repeat for both engines, got {len(ref_seconds)} and {len(seconds)}"
        )
    return [ref / t for ref, t in zip(ref_seconds, seconds)]


def paired_speedup(ref_seconds: list[float], seconds: list[float]) -> float:
    """Median of :func:`paired_ratios`: the speed-up reported in the table."""
    return statistics.median(paired_ratios(ref_seconds, seconds))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--new-tokens", type=int, default=None, help="override the config's new tokens")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="round-robin repeats: tokens/s from each engine's best time, ratios paired per repeat (median)",
    )
    parser.add_argument("--out", default=None, help="JSON output path (default bench_rollout_<config>.json)")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = CONFIGS[args.config]
    if args.new_tokens:
        cfg = BenchConfig(cfg.batch, cfg.prompt_len, args.new_tokens, cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg)
    prompts = make_prompts(cfg, model.config.vocab_size)
    params = linear_params(model)
    c = model.config
    rates = gemm_rates(cfg.batch, c.hidden_size, c.intermediate_size)

    prepared: dict[str, Prepared] = {}
    weights: dict[str, int] = {}  # per engine, weight bytes (-1: not measurable)
    memory: dict[str, int] = {}  # per engine, the largest warm-up peak RSS growth
    seconds: dict[str, list[float]] = {}  # per engine, the time of each repeat
    skipped: dict[str, str] = {}
    for _ in range(args.repeats):  # round-robin, so load from other processes hits every engine alike
        for name in args.engines:
            if name in skipped:
                continue
            if name not in prepared:
                try:
                    prepared[name] = prepare(name, model, prompts, cfg.new_tokens)
                except (ImportError, ValueError) as err:
                    skipped[name] = str(err).splitlines()[0]
                    print(f"{name}: skipped ({skipped[name]})", flush=True)
                    continue
                weights[name] = prepared[name].weight_bytes
                memory[name] = max(memory.get(name, 0), prepared[name].run_peak_bytes)
            elapsed = timed(prepared[name].run)
            print(f"{name}: {cfg.batch * cfg.new_tokens / elapsed:.0f} tok/s", flush=True)
            seconds.setdefault(name, []).append(elapsed)
            if name.startswith("vllm"):  # one vLLM LLM per process at a time: rebuilt every repeat
                prepared.pop(name).close()  # vLLM engines always have close

    rows = []
    for name in args.engines:
        if name in skipped:
            rows.append({"engine": name, "skipped": skipped[name]})
            continue
        elapsed = min(seconds[name])
        wbytes, run_b = weights[name], memory[name]
        precision = name.partition("-")[2]
        tok_s = cfg.batch * cfg.new_tokens / elapsed
        rate = rates["int8"] if precision == "int8" else rates["fp32"]
        rows.append(
            {
                "engine": name,
                "tokens_per_s": tok_s,
                "ms_per_step": 1000 * elapsed / cfg.new_tokens,
                "weights_mb": wbytes / 2**20 if wbytes >= 0 else None,
                "run_peak_mb": run_b / 2**20,
                "roofline_fraction": tok_s * 2 * params / rate,
                "roofline_rate": "int8" if precision == "int8" else "fp32",
                "seconds": seconds[name],
            }
        )

    for r in rows:
        for ref in ("torch-fp32", "hf-fp32"):
            if ref in seconds and "tokens_per_s" in r:
                key = f"vs_{ref.replace('-', '_')}"
                r[key] = paired_speedup(seconds[ref], seconds[r["engine"]])
                r[f"{key}_per_repeat"] = paired_ratios(seconds[ref], seconds[r["engine"]])
    result = {
        "config": args.config,
        "shape": asdict(cfg),
        "linear_params": params,
        "total_params": sum(p.numel() for p in model.parameters()),
        "gemm_gflops": {k: v / 1e9 for k, v in rates.items()},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "memory": "weights = bytes of the engine model's unique params+buffers (int8 packed: 1 B/weight); run = peak RSS growth during generate (/proc/self/statm, 2 ms sampling)",
        "repeats": args.repeats,
        "rows": rows,
    }
    out = args.out or f"bench_rollout_{args.config}.json"
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(markdown_table(result))
    return result


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


def markdown_table(result: dict) -> str:
    g = result["gemm_gflops"]
    lines = [
        f"config {result['config']}: batch {result['shape']['batch']}, {result['shape']['new_tokens']} new tokens, "
        f"{result['linear_params'] / 1e6:.2f}M linear params, {result['threads']} threads; "
        f"GEMM fp32 {g['fp32']:.1f} GFLOP/s, int8 {g['int8']:.1f} GFLOP/s",
        "",
        "| engine | tok/s (best) | ms/step | vs torch-fp32 (paired) | vs hf-fp32 (paired) | roofline | weights MB | run peak RSS MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['engine']} | skipped: {r['skipped'][:60]} | | | | | | |")
            continue
        lines.append(
            f"| {r['engine']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.1f} | {_ratio(r, 'vs_torch_fp32')} | {_ratio(r, 'vs_hf_fp32')} "
            f"| {100 * r['roofline_fraction']:.1f}% ({r['roofline_rate']}) | {'n/a' if r['weights_mb'] is None else format(r['weights_mb'], '.0f')} | {r['run_peak_mb']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
