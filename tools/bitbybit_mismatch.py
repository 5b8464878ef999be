"""Warm-start the tiny Qwen3, then measure the rollout mismatch of every rollout precision (issue #18).

The policy, the task, the warm start and the engines are built as ``ais-train`` builds them, from the config
composed of the options below and any ``ais-train`` overrides (``ais_lightning.toolkit.probes.compose``; the default:
the built-in tiny Qwen3 on ``task=arithmetic``).

1. **Warm start.** ``ais-train``'s warm start of the policy (``Components.initial_policy``: the library's cached
   ``ais_lightning.app.warmstart.warm_start`` of the built-in tiny Qwen3 initialised from ``--seed``): SFT on the task's
   reference solutions until the greedy accuracy on held-out prompts is in ``--band`` (``warmstart.target_band``,
   the paper preset's [0.65, 0.75]) within ``--sft-steps`` steps, ``--threads`` intra-op threads, everything
   seeded by ``--seed``. ``--save DIR`` writes the warm start as a Hugging Face directory (``save_tiny_model``)
   plus ``warmstart.json``; ``ais-train policy=local policy.path=DIR warmstart=disabled`` then trains from exactly
   these weights. ``--load DIR`` skips the SFT and builds that policy as such a run does (``policy=local
   policy.path=DIR``: attention as transformers picks it for a checkpoint, ``sdpa``, where the built-in model runs
   ``eager``; its figures match the ``--save`` run's to ~1e-5 relative).
2. **Per rollout precision** (``--precisions``; ``rollout.precision`` of the torch engine with its default
   backend: int8 = the integer W8A8 GEMM, everything else emulated): greedy accuracy on ``--eval-prompts``
   held-out prompts; then
   ``--samples`` samples per held-out prompt (``SamplingConfig(n, temperature, max_new_tokens)``, one seed
   for all precisions), the engine's log mu of each sampled token, log pi of the fp32 policy on the same
   tokens (``Policy.batch_logprobs``) and the mismatch ``MismatchKL("k3")`` (token mean, as logged in
   training) with its standard error over prompts (the tokens of one prompt are one cluster: ratio-
   estimator s.e., ``sqrt(P / (P - 1) * sum_p (s_p - KL n_p)^2) / sum_p n_p`` with ``s_p`` the prompt's
   k3 sum over ``n_p`` tokens, ``ais_lightning.toolkit.measure.clustered_kl``). Also ``k1``, the KL against QaRL's
   *aligned* trainer (the same weights under ``policy.aligned_quantization=<precision>``: the fp32 policy's
   forward run through the same recipe, what is left of the mismatch when the trainer emulates the engine),
   and the mean sampled reward.

Prints markdown tables (``--json`` writes every number). Deterministic for a fixed thread count.
Example (the figures in ``docs/quantization.md``)::

    OMP_NUM_THREADS=1 .venv/bin/python tools/bitbybit_mismatch.py --save /tmp/bitbybit_ws --json kl.json
    python tools/bitbybit_mismatch.py --load /tmp/bitbybit_ws --precisions fp32,int4 rollout.model_impl=transformers
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ais_lightning.quant import NESTED_INT_RECIPES

PRECISIONS = ("fp32", "fp8", "fp4", "int8", *NESTED_INT_RECIPES)
"""Default rollout precisions: the fp32 engine (should give ~0), the existing recipes, the Bit-by-Bit ones."""


def target_band(args: argparse.Namespace) -> list[float] | None:
    """``--band`` as ``warmstart.target_band``."""
    return None if args.band == "none" else [float(x) for x in args.band.split(",")]


def config_overrides(args: argparse.Namespace) -> list[str]:
    """The ``ais-train`` overrides of the command line: the options' settings, then the user's overrides."""
    from ais_lightning.toolkit.probes import override

    run = [
        f"seed={args.seed}",
        f"task.digits={args.digits}",
        f"algorithm.max_new_tokens={args.max_new_tokens}",
    ]
    if args.load:
        run += ["policy=local", override("policy.path", args.load), "warmstart.enabled=false"]
    else:
        run += [
            "warmstart.enabled=true",
            f"warmstart.steps={args.sft_steps}",
            f"warmstart.batch_size={args.batch_size}",
            override("warmstart.target_band", target_band(args)),
            f"warmstart.max_new_tokens={args.max_new_tokens}",
            f"warmstart.num_threads={args.threads}",
            f"warmstart.seed={args.seed}",
            override("warmstart.cache_dir", args.cache_dir),
        ]
    return [*run, *args.overrides]


def warm_start(args: argparse.Namespace, cfg, c):
    """The warm-started policy (``Components.initial_policy``: trained now or cached, or the ``--load``ed
    directory) and what to record about it."""
    from ais_lightning.models import save_tiny_model

    if args.load:
        meta_path = Path(args.load) / "warmstart.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"loaded": args.load}
        return c.policy.build(cfg.seed).eval(), meta
    policy, result = c.initial_policy(cfg.seed)
    print(f"warm start: {result.describe()}")
    meta = {
        "sft_steps": result.steps,
        "steps_trained": result.steps_trained,
        "greedy_accuracy_held_out": result.accuracy,
        "target_band": target_band(args),
        "batch_size": args.batch_size,
        "seed": args.seed,
        "threads": args.threads,
        "task": f"arithmetic digits={args.digits}",
        "cache_entry": str(result.path),
        "torch": torch.__version__,
    }
    if args.save:
        save_tiny_model(policy.model, policy.tokenizer, args.save)
        Path(args.save, "warmstart.json").write_text(json.dumps(meta, indent=2))
        print(f"saved the warm start to {args.save}")
    return policy.eval(), meta


def measure(policy, task, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Greedy accuracy and the mismatch of every rollout precision against the fp32 policy."""
    from ais_lightning.quant.recipes import RECIPES
    from ais_lightning.tasks import PromptDataModule
    from ais_lightning.toolkit.measure import (
        clustered_kl,
        greedy_accuracy,
        mismatch,
        sampled_reward,
        sampling_config,
        score_samples,
    )
    from ais_lightning.toolkit.probes import compose, engine_factory, policy_like

    samples = PromptDataModule(task, val_size=args.eval_prompts, seed=args.seed).val_samples()
    sampled = sampling_config(
        policy.tokenizer, args.samples, args.temperature, args.max_new_tokens, args.seed
    )
    overrides = config_overrides(args)
    rows = []
    for precision in args.precisions.split(","):
        t0 = time.perf_counter()
        engine = engine_factory(overrides, precision=precision)(policy.model)
        acc = greedy_accuracy(policy, engine, task, samples, args.max_new_tokens)
        batch, pi = score_samples(policy, engine, samples, sampled)
        mu, mask = batch.rollout_logprobs, batch.response_mask
        row = {"precision": precision, "greedy_accuracy": acc, **mismatch(pi, mu, mask, batch.prompt_index)}
        row["sampled_reward"] = sampled_reward(task, samples, batch, policy.tokenizer)
        if precision in RECIPES:  # QaRL: the trainer's forward emulates the engine's recipe
            spec = compose([*overrides, f"policy.aligned_quantization={precision}"])[1].policy
            aligned = policy_like(spec, policy, args.seed)
            aligned.apply_aligned_quantization()
            with torch.no_grad():
                pi_aligned = aligned.eval().batch_logprobs(batch, temperature=args.temperature).logprobs
            row["kl_k3_aligned"], row["kl_k3_aligned_se"] = clustered_kl(
                pi_aligned, mu, mask, batch.prompt_index
            )
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        aligned_text = f"  aligned {row['kl_k3_aligned']:.2e}" if "kl_k3_aligned" in row else ""
        print(
            f"{precision:>18}: greedy acc {row['greedy_accuracy']:.3f}  KL k3 {row['kl_k3']:.3e} ± "
            f"{row['kl_k3_se']:.1e}  k1 {row['kl_k1']:.2e}{aligned_text}  reward {row['sampled_reward']:.3f}  "
            f"({row['seconds']:.0f} s)",
            flush=True,
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    def aligned(r: dict[str, Any]) -> str:
        if "kl_k3_aligned" not in r:
            return "-"
        return f"{r['kl_k3_aligned']:.2e} ± {r['kl_k3_aligned_se']:.1e}"

    lines = [
        "| precision | greedy accuracy | KL k3 vs fp32 trainer (± s.e.) | KL k1 | max abs dlogp | "
        "KL k3 vs aligned trainer (± s.e.) | sampled reward |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| `{r['precision']}` | {r['greedy_accuracy']:.3f} | {r['kl_k3']:.2e} ± {r['kl_k3_se']:.1e} | "
            f"{r['kl_k1']:.2e} | {r['max_abs_dlogp']:.2e} | {aligned(r)} | {r['sampled_reward']:.3f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ais_lightning.toolkit.probes import add_overrides_argument

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--digits", type=int, default=2, help="arithmetic task: digits per operand")
    p.add_argument("--sft-steps", type=int, default=3000, help="SFT step budget (without a band: the count)")
    p.add_argument(
        "--band", default="0.65,0.75", help="warm-start target band low,high or none (paper preset)"
    )
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--cache-dir", default=None, help="warm-start cache (default: the library's)")
    p.add_argument("--seed", type=int, default=1, help="model init, SFT data, held-out prompts, sampling")
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt for the KL")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save", default=None, help="write the warm start here (Hugging Face directory)")
    p.add_argument("--load", default=None, help="load a warm start written by --save instead of training")
    p.add_argument("--json", default=None, help="write the warm-start record and every row here")
    add_overrides_argument(p)
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.save and args.load:
        print("bitbybit_mismatch: --save and --load exclude each other", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    from ais_lightning.toolkit.probes import compose, write_json

    cfg, c = compose(config_overrides(args))
    policy, meta = warm_start(args, cfg, c)
    rows = measure(policy, c.task, args)
    print(f"\nwarm start: {json.dumps(meta)}\n")
    print(markdown(rows))
    write_json(args.json, {"warm_start": meta, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
