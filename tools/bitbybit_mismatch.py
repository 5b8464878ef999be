"""Warm-start the tiny Qwen3, then measure the rollout mismatch of every rollout precision (issue #18).

1. **Warm start.** The library's warm start (``ais_lightning.warmstart.warm_start``, cached) of the
   built-in tiny Qwen3 (``build_tiny_qwen3(seed)``): SFT on the task's reference solutions until the
   greedy accuracy on held-out prompts is in ``--band`` (the paper preset's [0.65, 0.75]) within
   ``--sft-steps`` steps, ``--threads`` intra-op threads, everything seeded by ``--seed``. ``--save DIR`` writes the warm start as a Hugging Face
   directory (``save_tiny_model``) plus ``warmstart.json``; ``ais-train policy=local policy.path=DIR
   warmstart=disabled`` then trains from exactly these weights. ``--load DIR`` skips the SFT.
2. **Per rollout precision** (``--precisions``; ``TorchRolloutEngine`` with its default backend: int8 =
   the integer W8A8 GEMM, everything else emulated): greedy accuracy on ``--eval-prompts`` held-out prompts; then
   ``--samples`` samples per held-out prompt (``SamplingConfig(n, temperature, max_new_tokens)``, one seed
   for all precisions), the engine's log mu of each sampled token, log pi of the fp32 policy on the same
   tokens (``Policy.batch_logprobs``) and the mismatch ``MismatchKL("k3")`` (token mean, as logged in
   training) with its standard error over prompts (the tokens of one prompt are one cluster: ratio-
   estimator s.e., ``sqrt(P / (P - 1) * sum_p (s_p - KL n_p)^2) / sum_p n_p`` with ``s_p`` the prompt's
   k3 sum over ``n_p`` tokens). Also ``k1``, the KL against QaRL's *aligned* trainer (the fp32 policy's
   forward run through the same recipe, ``Policy(aligned_quantization=precision)``: what is left of the
   mismatch when the trainer emulates the engine), and the mean sampled reward.

Prints markdown tables (``--json`` writes every number). Deterministic for a fixed thread count.
Example (the figures in ``docs/quantization.md``)::

    OMP_NUM_THREADS=1 .venv/bin/python tools/bitbybit_mismatch.py --save /tmp/bitbybit_ws --json kl.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_mismatch import clustered_kl  # noqa: E402  (the tools share the clustered KL)

PRECISIONS = ("fp32", "fp8", "fp4", "int8", *NESTED_INT_RECIPES)
"""Default rollout precisions: the fp32 engine (should give ~0), the existing recipes, the Bit-by-Bit ones."""


def warm_start(args: argparse.Namespace):
    """The warm-started policy (trained now by ``ais_lightning.warmstart.warm_start``, or ``--load``ed) and
    what to record about it."""
    from ais_lightning.models import build_char_tokenizer, build_tiny_qwen3, save_tiny_model
    from ais_lightning.policy import Policy
    from ais_lightning.warmstart import WarmStartSettings
    from ais_lightning.warmstart import warm_start as sft_warm_start

    if args.load:
        policy = Policy.from_pretrained(
            args.load, attn_implementation="eager", tokenizer=build_char_tokenizer()
        )
        meta_path = Path(args.load) / "warmstart.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"loaded": args.load}
        return policy.eval(), meta
    policy = Policy(build_tiny_qwen3(seed=args.seed), build_char_tokenizer())
    band = None if args.band == "none" else [float(x) for x in args.band.split(",")]
    settings = WarmStartSettings(
        steps=args.sft_steps,
        batch_size=args.batch_size,
        target_band=band,
        max_new_tokens=args.max_new_tokens,
        num_threads=args.threads,
        seed=args.seed,
        cache_dir=args.cache_dir,
    )
    result = sft_warm_start(
        policy, policy.tokenizer, make_task(args), settings, seed=args.seed, progress_bar=False
    )
    print(f"warm start: {result.describe()}")
    meta = {
        "sft_steps": result.steps,
        "steps_trained": result.steps_trained,
        "greedy_accuracy_held_out": result.accuracy,
        "target_band": band,
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


def make_task(args: argparse.Namespace):
    from ais_lightning.tasks.arithmetic import Arithmetic

    return Arithmetic(digits=args.digits)


def measure(policy, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Greedy accuracy and the mismatch of every rollout precision against the fp32 policy."""
    from ais_lightning.diagnostics import MismatchKL
    from ais_lightning.policy import Policy
    from ais_lightning.quant.recipes import RECIPES
    from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
    from ais_lightning.tasks import PromptDataModule, accuracy, batch_rewards

    task = make_task(args)
    samples = PromptDataModule(task, val_size=args.eval_prompts, seed=args.seed).val_samples()
    tokenizer = policy.tokenizer
    prompts = policy.encode_prompts([s.prompt for s in samples])
    stop = [tokenizer.eos_token_id]
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=stop)
    sampled = SamplingConfig(
        n=args.samples,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=stop,
        seed=args.seed,
    )
    rows = []
    for precision in args.precisions.split(","):
        t0 = time.perf_counter()
        engine = TorchRolloutEngine(policy.model, precision=precision)
        acc = batch_rewards(task, samples, engine.generate(prompts, greedy), tokenizer)[0]
        batch = engine.generate(prompts, sampled)
        mu, mask = batch.rollout_logprobs, batch.response_mask
        with torch.no_grad():
            pi = policy.batch_logprobs(batch, temperature=args.temperature).logprobs
        k3, k1 = MismatchKL("k3"), MismatchKL("k1")
        k3.update(pi, mu, mask)
        k1.update(pi, mu, mask)
        kl, se = clustered_kl(pi, mu, mask, batch.prompt_index)
        row = {
            "precision": precision,
            "greedy_accuracy": accuracy(acc),
            "kl_k3": float(k3.compute()),
            "kl_k3_se": se,
            "kl_k3_clustered": kl,
            "kl_k1": float(k1.compute()),
            "max_abs_dlogp": float((pi - mu)[mask].abs().max()) if bool(mask.any()) else 0.0,
            "sampled_reward": sum(batch_rewards(task, samples, batch, tokenizer)[0])
            / len(batch.finish_reason),
            "tokens": int(mask.sum()),
        }
        if precision in RECIPES:  # QaRL: the trainer's forward emulates the engine's recipe
            aligned = Policy(policy.fresh_model(), tokenizer, aligned_quantization=precision)
            aligned.model.load_state_dict(policy.model.state_dict())
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
            f"{precision:>18}: greedy acc {row['greedy_accuracy']:.3f}  KL k3 {row['kl_k3']:.3e} ± {se:.1e}  "
            f"k1 {row['kl_k1']:.2e}{aligned_text}  reward {row['sampled_reward']:.3f}  ({row['seconds']:.0f} s)",
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.save and args.load:
        print("bitbybit_mismatch: --save and --load exclude each other", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    policy, meta = warm_start(args)
    rows = measure(policy, args)
    print(f"\nwarm start: {json.dumps(meta)}\n")
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"warm_start": meta, "args": vars(args), "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
