"""Rollout speed kept inside training: the GRPO loop's own phase timers at int8 + AIS vs fp32 + AIS, one run.

Each configuration (``rollout=<precision> corrector=ais`` on top of a preset) trains for ``--steps``
GRPO steps with the real ``GRPOModule`` loop; the numbers are the loop's own logged timers
``time/rollout_s``, ``time/logprob_s``, ``time/update_s``, ``time/sync_s`` and
``throughput/rollout_tokens_per_s``. A Lightning callback adds the wall time of each training step
(``on_train_batch_start`` to ``on_train_batch_end``), so ``other`` = step - the four phases (scoring,
advantages, the corrector, metrics, Lightning). It also records the process's CPU time over the
step: ``cores used`` = CPU seconds / wall seconds, which on a machine shared with other jobs says how
much of the ``--threads`` cores the run actually got.

One process runs the configurations as alternating segments: ``--repeats R`` rounds, each round one
segment per configuration, back to back (the order reverses every other round, so a load trend hits
both alike). Every segment builds the policy from the same seed and draws the same prompts, so two
segments of a round differ only in the rollout precision. On a shared machine the load drifts between
rounds by more than the differences measured, hence the *paired* ratios: per round, the int8 segment's
median rollout tokens/s over the fp32 segment's (and the fp32 step time over the int8 one), reported
as the median over rounds and the range of the per-round ratios, as ``tools/bench_rollout.py`` does.
Per configuration the table gives each phase's median seconds over all steps and its share of the
step (the phase's total time over the steps' total time, so the shares add up to 100%).

The run is assembled from the components ``ais-train`` builds (``ais_lightning.app.build.validate`` of
the composed config: policy, engine, corrector, loss, task, settings; ``GRPOModule``,
``PromptDataModule``) with a Lightning Trainer of one CPU process; validation, checkpoints and the
tracking logger are off (none of them is inside the timed phases; a checkpoint of the gemm policy and
its AdamW state is ~1.3 GB per segment).

    python tools/train_speed.py --config gemm --threads 2 --steps 2 --repeats 3 --json speed.json
    python tools/train_speed.py --config tiny --steps 2 --repeats 2 --rollouts int8 fp32 fp8
    python tools/train_speed.py --config gemm algorithm.max_new_tokens=32   # any ais-train override
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch

CONFIGS = {
    "gemm": ["experiment=speed_gemm"],
    "tiny": ["experiment=smoke"],
}
"""``ais-train`` overrides of each ``--config``: the ~105M GEMM-bound policy, or the 0.8M tiny one."""
PHASES = ("rollout", "logprob", "update", "sync")
"""The loop's timed phases, logged as ``time/<phase>_s``."""
THROUGHPUT = "throughput/rollout_tokens_per_s"
REFERENCE = "fp32"
"""The rollout precision every ratio is relative to."""
PRECISIONS = ("fp32", "int8", "fp8", "fp4", "bf16")


def config_overrides(
    config: str, precision: str, steps: int | None, threads: int | None, extra: list[str]
) -> list[str]:
    """The ``ais-train`` overrides of one configuration (``rollout=<precision> corrector=ais``)."""
    overrides = [*CONFIGS[config], f"rollout={precision}", "corrector=ais"]
    if steps is not None:
        overrides.append(f"trainer.max_steps={steps}")
    if threads is not None:
        overrides.append(f"trainer.num_threads={threads}")
    return [*overrides, *extra]


def _step_recorder() -> Any:
    from lightning import Callback

    class StepRecorder(Callback):
        """Per training step: the loop's logged timers and throughput, and the step's wall time."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self._start = self._cpu_start = 0.0

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self._start, self._cpu_start = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            wall = time.perf_counter() - self._start
            logged = trainer.callback_metrics
            keys = [f"time/{p}_s" for p in PHASES] + [THROUGHPUT]
            missing = [k for k in keys if k not in logged]
            if missing:
                raise RuntimeError(f"the training step logged no {missing} (a skipped step?)")
            step = {k: float(logged[k]) for k in keys}
            step["step_s"] = wall
            step["cpu_s"] = time.process_time() - self._cpu_start
            step["other_s"] = wall - sum(step[f"time/{p}_s"] for p in PHASES)
            self.steps.append(step)

    return StepRecorder()


def run_segment(overrides: list[str]) -> dict[str, Any]:
    """Train the ``trainer.max_steps`` GRPO steps of the config composed from ``overrides``, from scratch; the
    per-step timers and what the run was."""
    import lightning as L

    from ais_lightning.toolkit.probes import compose, measuring_trainer, one_process

    cfg, c = compose(overrides)
    one_process(c, "train_speed", warm_start=False)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    policy = c.policy.build(cfg.seed)
    module = c.grpo_module(policy, cfg.seed, validation=False)
    steps = c.trainer.max_steps
    data = c.prompt_data(steps, cfg.seed)  # the prompts ais-train would draw
    recorder = _step_recorder()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="train_speed_") as root:
        max_steps = steps * c.algorithm.optimizer_steps_per_rollout
        trainer = measuring_trainer(root, max_steps, c.trainer.precision, callbacks=[recorder])
        trainer.fit(module, datamodule=data)
    linear = sum(m.weight.numel() for m in policy.modules() if isinstance(m, torch.nn.Linear))
    info = {
        "steps": recorder.steps,
        "load_avg_1min": [load_before, os.getloadavg()[0]],
        "linear_params": linear,
        "rows": c.algorithm.prompts_per_step * c.algorithm.group_size,
        "max_new_tokens": c.algorithm.max_new_tokens,
    }
    del trainer, module, policy, data
    gc.collect()
    return info


def paired_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """``numerator[r] / denominator[r]`` per round: two segments that ran back to back."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"need one value per round for both, got {len(numerator)} and {len(denominator)}")
    return [a / b for a, b in zip(numerator, denominator)]


def summarize(segments: dict[str, list[dict[str, Any]]], warmup: int) -> list[dict[str, Any]]:
    """One row per configuration: medians, shares, segment values per round and the paired ratios.

    ``segments[precision][r]`` is round ``r``'s segment; its first ``warmup`` steps are left out.
    """
    rows = []
    for precision, segs in segments.items():
        kept = [s["steps"][warmup:] for s in segs]
        if not all(kept):
            raise ValueError(f"--warmup {warmup} leaves no step of a {precision} segment")
        flat = [step for seg in kept for step in seg]
        total = sum(step["step_s"] for step in flat)
        row: dict[str, Any] = {"rollout": precision, "steps_kept": len(flat)}
        for phase in (*PHASES, "other"):
            key = "other_s" if phase == "other" else f"time/{phase}_s"
            row[f"{phase}_s"] = statistics.median(step[key] for step in flat)
            row[f"{phase}_share"] = sum(step[key] for step in flat) / total
        row["step_s"] = statistics.median(step["step_s"] for step in flat)
        row["cores_used"] = sum(step["cpu_s"] for step in flat) / total
        row["rollout_tokens_per_s"] = statistics.median(step[THROUGHPUT] for step in flat)
        # per round (segment): the median over its kept steps, the value the paired ratios compare
        row["round_tokens_per_s"] = [statistics.median(st[THROUGHPUT] for st in seg) for seg in kept]
        row["round_step_s"] = [statistics.median(st["step_s"] for st in seg) for seg in kept]
        rows.append(row)
    ref = next((r for r in rows if r["rollout"] == REFERENCE), None)
    for row in rows:
        if ref is None:
            continue
        tok = paired_ratios(row["round_tokens_per_s"], ref["round_tokens_per_s"])
        step = paired_ratios(ref["round_step_s"], row["round_step_s"])
        row["rollout_speedup"], row["rollout_speedup_per_round"] = statistics.median(tok), tok
        row["step_speedup"], row["step_speedup_per_round"] = statistics.median(step), step
    return rows


def _ratio(row: dict[str, Any], key: str) -> str:
    """``2.01x (1.85-2.20)``: the paired median and the per-round range (no range when all agree)."""
    if key not in row:
        return "n/a"
    per_round = row[f"{key}_per_round"]
    spread = f" ({min(per_round):.2f}-{max(per_round):.2f})" if min(per_round) != max(per_round) else ""
    return f"{row[key]:.2f}x{spread}"


def markdown_table(result: dict[str, Any]) -> str:
    loads = [x for segs in result["segments"].values() for s in segs for x in s["load_avg_1min"]]
    lines = [
        f"config {result['config']}: {result['linear_params'] / 1e6:.1f}M linear params, {result['rollout_rows']} rows x "
        f"{result['max_new_tokens']} new tokens per rollout, corrector ais, {result['threads']} threads; "
        f"{result['repeats']} rounds x {result['steps']} steps per configuration, first {result['warmup']} "
        f"step(s) of each segment left out; 1-min load average {min(loads):.1f}-{max(loads):.1f} "
        f"on {os.cpu_count()} cores",
        "",
        "| rollout | rollout s (share) | log-prob s (share) | update s (share) | sync s (share) | other s (share) "
        f"| step s | cores used | rollout tok/s | rollout tok/s vs {REFERENCE} (paired) | step speed vs {REFERENCE} (paired) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        cells = [f"{r[f'{p}_s']:.2f} ({100 * r[f'{p}_share']:.0f}%)" for p in (*PHASES, "other")]
        lines.append(
            f"| {r['rollout']} | {' | '.join(cells)} | {r['step_s']:.2f} | {r['cores_used']:.2f} "
            f"| {r['rollout_tokens_per_s']:.0f} "
            f"| {_ratio(r, 'rollout_speedup')} | {_ratio(r, 'step_speedup')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from ais_lightning.toolkit.probes import add_overrides_argument, compose, quiet_run_logs, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="gemm")
    parser.add_argument("--rollouts", nargs="+", choices=PRECISIONS, default=["int8", REFERENCE])
    parser.add_argument(
        "--steps", type=int, default=None, help="GRPO steps per segment (default: the preset's)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds of one segment per configuration")
    parser.add_argument("--warmup", type=int, default=0, help="first steps of each segment left out")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (trainer.num_threads)"
    )
    parser.add_argument("--json", default=None, help="write the result (every step's timers) here")
    add_overrides_argument(parser)
    args = parser.parse_intermixed_args(argv)
    if REFERENCE not in args.rollouts:
        parser.error(f"--rollouts must include {REFERENCE}, the reference of the ratios")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")

    quiet_run_logs()
    configs = {
        p: config_overrides(args.config, p, args.steps, args.threads, args.overrides) for p in args.rollouts
    }
    for overrides in configs.values():  # every configuration checked before the first one runs
        compose(overrides)
    segments: dict[str, list[dict[str, Any]]] = {p: [] for p in args.rollouts}
    started = time.perf_counter()
    for r in range(args.repeats):
        order = args.rollouts if r % 2 == 0 else args.rollouts[::-1]
        for precision in order:
            seg = run_segment(configs[precision])
            segments[precision].append(seg)
            tok = ", ".join(f"{s[THROUGHPUT]:.0f}" for s in seg["steps"])
            print(
                f"round {r + 1}/{args.repeats} {precision}: rollout tok/s per step {tok}; "
                f"load {seg['load_avg_1min'][0]:.1f} -> {seg['load_avg_1min'][1]:.1f}",
                flush=True,
            )
    first = segments[args.rollouts[0]][0]
    result = {
        "config": args.config,
        "overrides": {
            p: list(CONFIGS[args.config]) + [f"rollout={p}", "corrector=ais"] for p in args.rollouts
        },
        "extra_overrides": args.overrides,
        "steps": len(first["steps"]),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "linear_params": first["linear_params"],
        "rollout_rows": first["rows"],
        "max_new_tokens": first["max_new_tokens"],
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "wall_s": time.perf_counter() - started,
        "segments": segments,
    }
    result["rows"] = summarize(segments, args.warmup)
    write_json(args.json, result)
    print(markdown_table(result))
    return result


if __name__ == "__main__":
    main()
