"""Steps per second of the asynchronous Ray pipeline against the synchronous loop, side by side, with the same cores.

Two ``ais-train`` runs of the same configuration (``--steps`` rollout steps, validation off, CSV logger):

- **sync**: the synchronous loop in one process with ``--threads`` torch threads (generate, update, sync);
- **ray**: ``algorithm.max_staleness=1 workers=ray`` with the trainer on ``--trainer-threads`` threads and
  ``--workers`` rollout workers of ``--worker-threads`` threads each (the same cores in total by default: 1 + 1).

Per run the median over the steps after ``--skip`` (the pipeline fills) of the loop's own timers: ``time/step_s``
(wall time from one training step to the next), ``time/rollout_s`` (sync: the generation; ray: the time the trainer
waited for rollouts) and the rest of the step. The **ideal overlap bound** is the synchronous step over
max(generation, the rest): what a pipeline that hides the shorter of the two entirely would reach. Printed: both
step times, the generation's share of the synchronous step (the comparison is meaningful when it is at least
40%), the speed-up ``sync step / ray step``, the bound and the fraction of it reached.

    python tools/async_throughput.py                        # the tiny model, 32-token responses (generation-bound)
    python tools/async_throughput.py --steps 6 --skip 2 experiment=smollm2_arith algorithm.val_size=16 \
        algorithm.micro_batch_size=16                       # the real pretrained LM (minutes per step)
    python tools/async_throughput.py --json out.json algorithm.max_new_tokens=64   # any ais-train override

On a machine shared with other jobs every number moves with their load: the two runs are sequential, so quote the
fraction of the bound from one invocation on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFAULT = [
    "experiment=smoke",
    "algorithm.prompts_per_step=16",
    "algorithm.group_size=8",
    "algorithm.max_new_tokens=32",
]
"""The default configuration: the tiny Qwen3 without a warm start, whose responses run to the 32-token budget, so
generation is most of a synchronous step."""


def run(overrides: list[str], out: Path, timeout: float) -> list[dict[str, float]]:
    """One ``ais-train`` run; its per-step logged metrics (rows with ``time/update_s``)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    command = [
        sys.executable,
        "-m",
        "ais_lightning.app.train",
        *overrides,
        "logger=csv",
        f"hydra.run.dir={out}",
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = csv.DictReader(open(next(out.glob("csv/**/metrics.csv"))))
    return [
        {k: float(v) for k, v in r.items() if v not in ("", None)} for r in rows if r.get("time/update_s")
    ]


def phases(rows: list[dict[str, float]], skip: int) -> dict[str, float]:
    """Medians over the steps after ``skip``: the step, the rollout (generation or wait) and the rest."""
    kept = [r for r in rows if "time/step_s" in r][skip:]
    if not kept:
        raise SystemExit(f"no step after --skip {skip} has time/step_s; raise --steps")
    step = statistics.median(r["time/step_s"] for r in kept)
    rollout = statistics.median(r["time/rollout_s"] for r in kept)
    out = {"step_s": step, "rollout_s": rollout, "rest_s": step - rollout, "steps": float(len(kept))}
    if "async/worker_generate_s" in kept[0]:
        out["worker_generate_s"] = statistics.median(r["async/worker_generate_s"] for r in kept)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default = " ".join(DEFAULT)
    parser.add_argument("overrides", nargs="*", help=f"ais-train overrides (default: {default})")
    parser.add_argument("--steps", type=int, default=16, help="rollout steps per run")
    parser.add_argument("--skip", type=int, default=4, help="first steps left out (the pipeline fills)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the synchronous run")
    parser.add_argument(
        "--trainer-threads", type=int, default=1, help="torch threads of the pipeline's trainer"
    )
    parser.add_argument("--worker-threads", type=int, default=1, help="torch threads per rollout worker")
    parser.add_argument("--workers", type=int, default=1, help="rollout workers")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    base = [
        *(args.overrides or DEFAULT),
        f"trainer.max_steps={args.steps}",
        "algorithm.val_every_n_steps=100000",
    ]
    base += ["trainer.enable_progress_bar=false"]
    sync = [*base, "algorithm.max_staleness=0", f"trainer.num_threads={args.threads}"]
    ray = [
        *base,
        "algorithm.max_staleness=1",
        "workers=ray",
        f"workers.num_workers={args.workers}",
        f"workers.threads={args.worker_threads}",
        f"workers.num_cpus={args.worker_threads}",
        f"trainer.num_threads={args.trainer_threads}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        s = phases(run(sync, Path(tmp) / "sync", args.timeout), args.skip)
        r = phases(run(ray, Path(tmp) / "ray", args.timeout), args.skip)
    bound = s["step_s"] / max(s["rollout_s"], s["rest_s"])
    speedup = s["step_s"] / r["step_s"]
    figures: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "overrides": args.overrides or DEFAULT,
        "sync": s,
        "ray": r,
        "generation_share": s["rollout_s"] / s["step_s"],
        "speedup": speedup,
        "ideal_bound": bound,
        "fraction_of_bound": speedup / bound,
    }
    print(f"configuration: {' '.join(figures['overrides'])}; {figures['machine']}")
    print(
        f"threads: sync {args.threads}; pipeline trainer {args.trainer_threads} + {args.workers} x {args.worker_threads}"
    )
    print("| run | step (s) | rollout (s) | rest (s) |")
    print("| --- | --- | --- | --- |")
    for name, p in (("sync", s), ("ray (max_staleness=1)", r)):
        print(f"| {name} | {p['step_s']:.3f} | {p['rollout_s']:.3f} | {p['rest_s']:.3f} |")
    print(
        f"generation {100 * figures['generation_share']:.0f}% of the synchronous step; speed-up {speedup:.2f}x; "
        f"ideal overlap bound {bound:.2f}x; reached {100 * figures['fraction_of_bound']:.0f}% of it"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
