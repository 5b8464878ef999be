"""Build the paper preset's warm start in separate processes and report what each one reached.

Every configuration (seed x the run's intra-op threads x the SFT's threads) runs in its own
process with its own empty cache directory, so each one really trains. Printed per process: the
cache key, a SHA-256 of the warm-started weights (equal hashes = bit-identical weights), the greedy
accuracy the band-stop measured on its held-out prompts, the greedy accuracy of the same weights on
the RL validation prompts of seeds 0/1/2 (256 each, what ``ais-train`` reads at step 0), the steps
behind the weights, all steps trained (back-offs included), the back-offs and the wall time.

    python tools/measure_warmstart.py --run-threads 1 2                 # the issue #19 check
    python tools/measure_warmstart.py --seeds 0 1 2 --sft-threads 1 2 --jobs 2   # robustness to chaos
    python tools/measure_warmstart.py --band none --steps 500           # a fixed-step SFT, for comparison
    python tools/measure_warmstart.py --trace-every 2 --steps 800 --seeds 0 1 2 --jobs 2
        # trace mode: no stop, accuracy every 2 steps; prints how much it moves between evaluations

The policy, the task and the warm-start settings are built as ``ais-train`` builds them, from the config composed
of the options and any ``ais-train`` overrides given (``ais_lightning.toolkit.probes.compose``; default the built-in tiny
Qwen3 on 2-digit addition, ``task=arithmetic``), and the warm start is ``ais-train``'s (the library's
``warm_start``, as ``Components.initial_policy`` runs it, with the policy initialised from ``--init-seed``).
Settings not given on the command line are the ``WarmStartSettings`` defaults, except the paper
preset's band and step budget (``--band 0.65,0.75 --steps 3000``) and the RL validation's response
length (``--max-new-tokens 8``).

    python tools/measure_warmstart.py --seeds 1 task.digits=3        # any ais-train override
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import product

PAPER_BAND = "0.65,0.75"
PAPER_STEPS = 3000
RL_VAL_SEEDS = (0, 1, 2)
RL_VAL_SIZE = 256
RL_MAX_NEW_TOKENS = 8


def config_overrides(args: argparse.Namespace) -> list[str]:
    """The ``ais-train`` overrides of a worker: the warm start's settings from the options, then the user's."""
    from ais_lightning.toolkit.probes import override

    settings = {k: v for k, v in vars(args).items() if k in SETTING_ARGS and v is not None}
    band = settings.pop("band", PAPER_BAND)
    settings["target_band"] = None if band == "none" else [float(x) for x in band.split(",")]
    settings.update(cache_dir=args.cache_dir, seed=args.seed, num_threads=args.sft_threads)
    run = ["task=arithmetic", "warmstart.enabled=true", f"seed={args.seed}"]
    return [*run, *(override(f"warmstart.{k}", v) for k, v in settings.items()), *args.overrides]


def worker(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.run_threads)  # the run's setting, as ais-train's trainer.num_threads
    from ais_lightning.app.warmstart import GreedyAccuracy, state_dict_sha256, warm_start
    from ais_lightning.tasks.datamodule import draw_sample
    from ais_lightning.toolkit.probes import compose

    _, c = compose(config_overrides(args))
    task, settings = c.task, c.warmstart
    policy = c.policy.build(args.init_seed if args.init_seed is not None else args.seed)
    tokenizer = policy.tokenizer
    if args.trace_every:
        return trace(args, policy, tokenizer, task, settings)
    started, cpu_started = time.perf_counter(), time.process_time()
    result = warm_start(policy, tokenizer, task, settings, seed=args.seed, progress_bar=False)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    rl_val = {}
    for seed in RL_VAL_SEEDS:
        samples = [draw_sample(task, seed, "val", i) for i in range(RL_VAL_SIZE)]
        rl_val[str(seed)] = GreedyAccuracy(policy, tokenizer, task, samples, RL_MAX_NEW_TOKENS, 256)()
    return {
        "seed": args.seed,
        "run_threads": args.run_threads,
        "sft_threads": args.sft_threads,
        "key": result.key,
        "weights": state_dict_sha256(policy.model)[:12],
        "accuracy": result.accuracy,
        "rl_val": rl_val,
        "steps": result.steps,
        "steps_trained": result.steps_trained,
        "backoffs": result.backoffs,
        "wall_s": wall,
        "cpu_s": cpu,
        "history": result.history,
    }


def trace(args: argparse.Namespace, policy, tokenizer, task, settings) -> dict:
    """Train ``--steps`` steps without stopping, evaluating every ``--trace-every`` steps."""
    import dataclasses

    import torch

    from ais_lightning.app.warmstart import WarmStartError, intra_op_threads, train_warm_start

    settings = dataclasses.replace(settings, target_band=[1.0, 1.0], eval_every=args.trace_every)
    with intra_op_threads(settings.num_threads or torch.get_num_threads()):
        try:
            history = train_warm_start(policy, tokenizer, task, settings, args.seed, False)["history"]
        except WarmStartError as err:  # the budget ran out below 1.0: the normal end of a trace
            history = err.history
    return {
        "seed": args.seed,
        "run_threads": args.run_threads,
        "sft_threads": args.sft_threads,
        "trace": [(h["step"], h["accuracy"]) for h in history],
    }


def moves(trace: list, low: float = 0.3, high: float = 0.9) -> dict:
    """Accuracy changes between consecutive evaluations that start in [low, high]."""
    deltas = [b - a for (_, a), (_, b) in zip(trace, trace[1:]) if low <= a <= high]
    size = sorted(abs(d) for d in deltas)
    if not size:
        return {"n": 0}
    return {
        "n": len(deltas),
        "mean_abs": sum(size) / len(size),
        "p90_abs": size[int(0.9 * (len(size) - 1))],
        "max_abs": size[-1],
        "up_over_0.1": sum(d > 0.1 for d in deltas) / len(deltas),
        "first_0.65": next((step for step, acc in trace if acc >= 0.65), None),
    }


SETTING_ARGS = ("band", "steps", "lr", "batch_size", "eval_every", "eval_size", "max_new_tokens", "grad_clip")


def main(argv: list[str] | None = None) -> None:
    from ais_lightning.toolkit.probes import add_overrides_argument, write_json

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="warm-start seeds (paper: 1)")
    parser.add_argument("--run-threads", type=int, nargs="+", default=[1], help="torch threads of the run")
    parser.add_argument(
        "--sft-threads", type=int, nargs="+", default=[1], help="WarmStartSettings.num_threads"
    )
    parser.add_argument("--init-seed", type=int, default=None, help="model init seed (default: the seed)")
    parser.add_argument("--band", default=None, help=f"low,high or none (default {PAPER_BAND})")
    parser.add_argument("--steps", type=int, default=PAPER_STEPS, help=f"step budget (default {PAPER_STEPS})")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--eval-size", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=RL_MAX_NEW_TOKENS)
    parser.add_argument("--grad-clip", type=float)
    parser.add_argument("--jobs", type=int, default=1, help="processes at a time")
    parser.add_argument(
        "--trace-every", type=int, default=0, help="trace mode: train --steps steps, evaluate every N"
    )
    parser.add_argument("--json", default=None, help="also write every result (with histories) here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    add_overrides_argument(parser)
    args = parser.parse_intermixed_args(argv)
    if args.worker:
        args.run_threads, args.sft_threads = args.run_threads[0], args.sft_threads[0]
        print(json.dumps(worker(args)))
        return

    def launch(config: tuple[int, int, int]) -> dict:
        seed, run_threads, sft_threads = config
        with tempfile.TemporaryDirectory(prefix="warmstart-measure-") as cache:
            cmd = [sys.executable, __file__, "--worker", "--seed", str(seed), "--cache-dir", cache]
            cmd += ["--run-threads", str(run_threads), "--sft-threads", str(sft_threads)]
            cmd += ["--trace-every", str(args.trace_every), *args.overrides]
            for name in ("init_seed", *SETTING_ARGS):
                value = getattr(args, name)
                if value is not None:
                    cmd += [f"--{name.replace('_', '-')}", str(value)]
            env = {**os.environ, "OMP_NUM_THREADS": str(max(run_threads, sft_threads))}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode:
                return {
                    "seed": seed,
                    "run_threads": run_threads,
                    "sft_threads": sft_threads,
                    "error": out.stderr[-2000:],
                }
            return json.loads(out.stdout.strip().splitlines()[-1])

    configs = list(product(args.seeds, args.run_threads, args.sft_threads))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(launch, configs))
    if args.trace_every:
        print(
            "| seed | SFT threads | first step >= 0.65 | evals in [0.3, 0.9] | mean abs change | p90 | max "
            "| share of rises > 0.1 |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            if "error" in r:
                print(f"| {r['seed']} | {r['sft_threads']} | failed: {r['error'].splitlines()[-1]} |")
                continue
            m = moves(r["trace"])
            if not m["n"]:
                print(f"| {r['seed']} | {r['sft_threads']} | never reached 0.3 |")
                continue
            print(
                f"| {r['seed']} | {r['sft_threads']} | {m['first_0.65']} | {m['n']} | {m['mean_abs']:.3f} "
                f"| {m['p90_abs']:.3f} | {m['max_abs']:.3f} | {m['up_over_0.1']:.2f} |"
            )
        write_json(args.json, results, indent=1)
        return
    print(
        "| seed | run threads | SFT threads | key | weights | held-out acc | RL val acc (seeds 0/1/2) "
        "| steps | steps trained | back-offs | wall s | CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(
                f"| {r['seed']} | {r['run_threads']} | {r['sft_threads']} | failed: {r['error'].splitlines()[-1]} |"
            )
            continue
        rl = " / ".join(f"{r['rl_val'][str(s)]:.3f}" for s in RL_VAL_SEEDS)
        print(
            f"| {r['seed']} | {r['run_threads']} | {r['sft_threads']} | {r['key'][:8]} | {r['weights']} "
            f"| {r['accuracy']:.3f} | {rl} | {r['steps']} | {r['steps_trained']} | {r['backoffs']} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} |"
        )
    write_json(args.json, results, indent=1)


if __name__ == "__main__":
    main()
