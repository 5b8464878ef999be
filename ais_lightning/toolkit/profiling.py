"""The rollout profiler of ``tools/profile_rollout.py`` and ``tools/bench_rollout.py --profile``: where a torch
engine's decode step spends its time, per operator and per function of ``ais_lightning``, from two profiled
``generate`` calls (one prefill-only, one of full length) whose difference is divided by the extra steps."""

from __future__ import annotations

import re

import torch
from torch.profiler import ProfilerActivity, profile

from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
from ais_lightning.toolkit.measure import timed

_FRAME = re.compile(r"ais_lightning/(?:[\w/]*/)?(\w+)\.py\(\d+\): (.+)$")
"""A Python-function event of ``ais_lightning``: ``.../ais_lightning/rollout/torch_model.py(367): decode_layer``."""
LOOP_MODULE = "torch_engine"
"""The module of the sampling loop: only what runs under it is charged, to the functions below it."""
LOOP_KEY = "torch_engine (the sampling loop itself)"


def operator_times(prof) -> dict[str, tuple[float, int]]:
    """``{operator: (self CPU ms, calls)}`` of a finished ``torch.profiler.profile``."""
    return {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}


def function_times(prof) -> dict[str, tuple[float, int]]:
    """``{call chain: (self CPU ms, calls)}`` of a profile recorded with ``with_stack=True``.

    Every event's self time (operators, and the Python functions' own time) is charged to the chain of
    ``ais_lightning`` functions above it, from the outermost one below the sampling loop (module
    :data:`LOOP_MODULE`) to the innermost, e.g. ``decoders.step > torch_model.logits``; functions of other
    packages (torch, transformers) are transparent. ``calls``: how often the chain's last function was
    entered. Events outside the sampling loop (the profiler's own) are left out.
    """
    out: dict[str, tuple[float, int]] = {}
    for event in prof.events():
        frames, inside, node = [], False, event
        while node is not None:
            match = _FRAME.search(node.name)
            if match is not None:
                module, func = match.groups()
                if module == LOOP_MODULE:
                    inside = True
                    break
                frames.append(f"{module}.{func}")
            node = node.cpu_parent
        if not inside:
            continue
        key = " > ".join(reversed(frames)) or LOOP_KEY
        entered = int(_FRAME.search(event.name) is not None and bool(frames))
        ms, calls = out.get(key, (0.0, 0))
        out[key] = (ms + event.self_cpu_time_total / 1e3, calls + entered)
    return out


def rollup(rows: list[tuple[str, float, float]], depth: int) -> list[tuple[str, float, float]]:
    """Decode rows of call chains summed over their first ``depth`` functions, most expensive first
    (``calls``: those of the chains that end at that depth)."""
    merged: dict[str, list[float]] = {}
    for chain, ms, calls in rows:
        parts = chain.split(" > ")
        key = " > ".join(parts[:depth])
        entry = merged.setdefault(key, [0.0, 0.0])
        entry[0] += ms
        if len(parts) <= depth:
            entry[1] += calls
    return sorted(((k, ms, calls) for k, (ms, calls) in merged.items()), key=lambda r: r[1], reverse=True)


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


def _generate(engine: TorchRolloutEngine, prompts: list[list[int]], samples: int, new: int) -> None:
    engine.generate(prompts, SamplingConfig(n=samples, max_new_tokens=new, seed=0))


def _profiled(engine, prompts, samples, new, stacks: bool = False) -> dict[str, tuple[float, int]]:
    with profile(activities=[ProfilerActivity.CPU], with_stack=stacks) as prof:
        _generate(engine, prompts, samples, new)
    return function_times(prof) if stacks else operator_times(prof)


def profile_engine(
    engine: TorchRolloutEngine, prompts: list[list[int]], samples: int, new: int, functions: bool = False
) -> dict:
    """Per-step decode costs of ``engine`` on ``prompts`` x ``samples`` rows (per operator; per function too
    with ``functions``), and the unprofiled decode ms/step of the same two calls. ``new`` >= 2."""
    if new < 2:
        raise ValueError(f"new must be >= 2 (one prefill-only call is subtracted), got {new}")
    _generate(engine, prompts, samples, new)  # warm-up at full length
    short = timed(lambda: _generate(engine, prompts, samples, 1))
    full_s = timed(lambda: _generate(engine, prompts, samples, new))
    prefill = _profiled(engine, prompts, samples, 1)
    full = _profiled(engine, prompts, samples, new)
    decode = decode_step_costs(prefill, full, new - 1)
    result = {
        "model_impl": engine.model_impl,
        "threads": torch.get_num_threads(),
        "new_tokens": new,
        "unprofiled_decode_ms_per_step": 1000 * (full_s - short) / (new - 1),
        "prefill_ms": sum(ms for ms, _ in prefill.values()),
        "decode_ms_per_step": sum(ms for _, ms, _ in decode),
        "decode": decode,
        "prefill": sorted(((k, ms) for k, (ms, _) in prefill.items()), key=lambda r: r[1], reverse=True),
    }
    if functions:
        prefill_f = _profiled(engine, prompts, samples, 1, stacks=True)
        full_f = _profiled(engine, prompts, samples, new, stacks=True)
        # chains entered as often in the prefill-only call as in the full one belong to the prefill: dropped
        costs = decode_step_costs(prefill_f, full_f, new - 1)
        by_function = [row for row in costs if row[2] > 0 or row[0] == LOOP_KEY]
        result["decode_functions"] = by_function
        result["decode_functions_ms_per_step"] = sum(ms for _, ms, _ in by_function)
    return result


def _function_table(rows: list[tuple[str, float, float]], total: float, top: int, title: str) -> list[str]:
    lines = [f"| {title} | ms/step | share | calls/step |", "| --- | ---: | ---: | ---: |"]
    shown = rows[:top]
    for name, ms, calls in shown:
        lines.append(f"| {name} | {ms:.2f} | {100 * ms / total:.1f}% | {calls:.1f} |")
    rest = total - sum(ms for _, ms, _ in shown)
    if len(rows) > len(shown):
        lines.append(f"| (all other) | {rest:.2f} | {100 * rest / total:.1f}% | |")
    return lines


def markdown(result: dict, top: int) -> str:
    """The profile of :func:`profile_engine` (with ``config``, ``precision`` and ``batch`` added) as Markdown tables:
    the decode step per operator (and per function), the prefill per operator; ``top`` rows each."""
    batch = f", batch {result['batch']}" if "batch" in result else ""
    prefix = f"config {result['config']}, " if "config" in result else ""
    lines = [
        f"{prefix}precision {result['precision']}{batch}, {result['threads']} threads: "
        f"prefill {result['prefill_ms']:.0f} ms, decode {result['decode_ms_per_step']:.1f} ms/step profiled "
        f"({result['unprofiled_decode_ms_per_step']:.1f} unprofiled)",
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
    if "decode_functions" in result:
        rows, f_total = result["decode_functions"], result["decode_functions_ms_per_step"]
        lines += [
            "",
            f"decode step by function (profiled with Python stacks: {f_total:.1f} ms/step)",
            "",
            *_function_table(rollup(rows, 2), f_total, top, "function (first two levels)"),
            "",
            *_function_table(rows, f_total, top, "function (full call chain)"),
        ]
    lines += ["", "| prefill operator | ms | share |", "| --- | ---: | ---: |"]
    for name, ms in result["prefill"][:top]:
        lines.append(f"| {name} | {ms:.1f} | {100 * ms / result['prefill_ms']:.1f}% |")
    return "\n".join(lines)
