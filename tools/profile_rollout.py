"""Where a torch-engine rollout spends its time: per-operator CPU time of the prefill and of a decode step.

Profiles two ``generate`` calls of one ``TorchRolloutEngine`` with ``torch.profiler`` on a
``tools/bench_rollout.py`` config (same model and prompts): one that only prefills (1 new token) and
one of full length. An operator's decode cost per step is its time in the full call minus its time
in the prefill-only call, divided by the extra steps. Self time is used (an operator's own time,
without the operators it calls), so the rows add up to the total.

The profiler adds overhead to every operator call, which weighs most on the many small ones; read
the shares and the large rows, and take speed from ``tools/bench_rollout.py``.

    python tools/profile_rollout.py --config gemm --precision int8 --threads 2
    python tools/profile_rollout.py --config gemm --precision int8 --model-impl transformers   # the model's forward
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_rollout  # noqa: E402  (a sibling script: same configs, model and prompts)

from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine  # noqa: E402
from ais_lightning.rollout.torch_engine import MODEL_IMPLS, PRECISIONS  # noqa: E402


def operator_times(prof) -> dict[str, tuple[float, int]]:
    """``{operator: (self CPU ms, calls)}`` of a finished ``torch.profiler.profile``."""
    return {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}


def decode_step_costs(
    prefill: dict[str, tuple[float, int]], full: dict[str, tuple[float, int]], steps: int
) -> list[tuple[str, float, float]]:
    """Per operator ``(name, ms per decode step, calls per decode step)``, most expensive first.

    ``prefill`` / ``full``: :func:`operator_times` of a prefill-only call and of a call with ``steps``
    more decode steps. Operators the prefill-only call did not run count from zero.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    rows = []
    for name, (ms, calls) in full.items():
        ms0, calls0 = prefill.get(name, (0.0, 0))
        rows.append((name, (ms - ms0) / steps, (calls - calls0) / steps))
    return sorted(rows, key=lambda r: r[1], reverse=True)


def _profiled(engine: TorchRolloutEngine, prompts: list[list[int]], new: int) -> dict[str, tuple[float, int]]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(prompts, SamplingConfig(max_new_tokens=new, seed=0))
    return operator_times(prof)


def markdown(result: dict, top: int) -> str:
    lines = [
        f"config {result['config']}, precision {result['precision']}, {result['threads']} threads: "
        f"prefill {result['prefill_ms']:.0f} ms, decode {result['decode_ms_per_step']:.1f} ms/step (profiled)",
        "",
        "| decode operator | ms/step | share | calls/step |",
        "| --- | ---: | ---: | ---: |",
    ]
    total = result["decode_ms_per_step"]
    shown = result["decode"][:top]
    for name, ms, calls in shown:
        lines.append(f"| {name} | {ms:.2f} | {100 * ms / total:.1f}% | {calls:.1f} |")
    rest = total - sum(ms for _, ms, _ in shown)
    lines.append(f"| (all other operators) | {rest:.2f} | {100 * rest / total:.1f}% | |")
    lines += ["", "| prefill operator | ms | share |", "| --- | ---: | ---: |"]
    for name, ms in result["prefill"][:top]:
        lines.append(f"| {name} | {ms:.1f} | {100 * ms / result['prefill_ms']:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(bench_rollout.CONFIGS), default="gemm")
    parser.add_argument("--precision", choices=PRECISIONS, default="int8")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="override the config's new tokens (>= 2)"
    )
    parser.add_argument(
        "--model-impl",
        choices=MODEL_IMPLS,
        default="auto",
        help="the engine's forward (transformers: the model's own)",
    )
    parser.add_argument("--top", type=int, default=15, help="operators listed per table")
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    cfg = bench_rollout.CONFIGS[args.config]
    new = args.new_tokens or cfg.new_tokens
    if new < 2:
        parser.error(f"--new-tokens must be >= 2 (one prefill-only call is subtracted), got {new}")
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = bench_rollout.build_model(cfg)
    prompts = bench_rollout.make_prompts(cfg, model.config.vocab_size)
    engine = TorchRolloutEngine(model, precision=args.precision, model_impl=args.model_impl)
    engine.generate(prompts, SamplingConfig(max_new_tokens=new, seed=0))  # warm-up at full length
    prefill = _profiled(engine, prompts, 1)
    full = _profiled(engine, prompts, new)
    decode = decode_step_costs(prefill, full, new - 1)
    result = {
        "config": args.config,
        "precision": args.precision,
        "model_impl": engine.model_impl,
        "threads": torch.get_num_threads(),
        "new_tokens": new,
        "prefill_ms": sum(ms for ms, _ in prefill.values()),
        "decode_ms_per_step": sum(ms for _, ms, _ in decode),
        "decode": decode,
        "prefill": sorted(((k, ms) for k, (ms, _) in prefill.items()), key=lambda r: r[1], reverse=True),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(markdown(result, args.top))
    return result


if __name__ == "__main__":
    main()
