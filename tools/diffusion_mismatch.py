"""Warm-start the tiny masked-diffusion LM on a task, then measure mu vs pi at each rollout precision.

The policy (``policy=tiny_llada``, initialised from ``--seed``), the task and the engines (``rollout=llada_fp32``
with ``rollout.precision``, ``rollout.remasking``, ``rollout.block_length`` and ``rollout.steps`` of each row) are
built as ``ais-train`` builds them, from the config composed of the options below and any ``ais-train``
overrides (``ais_lightning.toolkit.probes.compose``, e.g. ``task=countdown`` or ``policy.mask_eps=0.01``).

1. SFT (LLaDA's masked-token loss, ``DiffusionPolicy.sft_loss``) of the policy on the task (default: 2-digit
   addition) for ``--sft-steps`` AdamW steps (linear warm-up, cosine decay to 10 %, gradient-norm clip 1), or
   ``--load`` saved weights (``--save`` writes them).
2. Greedy accuracy (temperature 0) of the warm-started model with the fp32 engine and with each
   precision, on ``--eval-prompts`` held-out prompts (the train stream is disjoint from them).
3. For each precision and remasking strategy: ``--samples`` samples per held-out prompt at temperature
   ``--temperature`` from ``DiffusionRolloutEngine``, their log mu, log pi from the fp32 policy on the
   engine's own path (``DiffusionPolicy.batch_logprobs``), and the mismatch KL (k3 and k1,
   ``ais_lightning.diagnostics.MismatchKL``; the s.e. of k3 over prompts, the tokens of one prompt one cluster:
   ``ais_lightning.toolkit.measure.clustered_kl``), the largest |log pi - log mu| and the sampled reward.

Prints a markdown table (and ``--out`` JSON). Everything is seeded; ``--threads`` intra-op threads
(default 1: the SFT is bit-reproducible for a fixed thread count). Example (the figures in
``docs/diffusion.md``)::

    python tools/diffusion_mismatch.py --sft-steps 500 --out diffusion_mismatch.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16", "int8", "fp8", "fp4")


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10 % at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def sft(policy, data, steps: int, lr: float, seed: int, log_every: int = 100) -> list[float]:
    """``steps`` AdamW steps of ``policy.sft_loss`` on the data module's train stream; returns the losses."""
    from ais_lightning.modules.sft import encode_pairs

    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, min(50, steps)))
    gen = torch.Generator().manual_seed(seed)
    losses, t0 = [], time.perf_counter()
    for step, batch in enumerate(data.train_stream()):
        if step == steps:
            break
        pairs = encode_pairs(policy.tokenizer, batch["prompt"], batch["solution"])
        loss = policy.sft_loss(*pairs, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            recent = losses[-log_every:]
            print(
                f"sft step {step + 1}: loss {sum(recent) / len(recent):.4f} ({time.perf_counter() - t0:.0f} s)"
            )
    return losses


def config_overrides(args: argparse.Namespace) -> list[str]:
    """The ``ais-train`` overrides of the command line: the options' settings, then the user's overrides."""
    task = [f"task={args.task}", *([f"task.digits={args.digits}"] if args.task == "arithmetic" else [])]
    run = ["policy=tiny_llada", "rollout=llada_fp32", "warmstart=disabled", f"seed={args.seed}", *task]
    return [*run, f"algorithm.max_new_tokens={args.max_new_tokens}", *args.overrides]


def measure(policy, task, samples, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Greedy accuracy, mismatch KL and sampled reward of every (remasking, precision) engine."""
    from ais_lightning.toolkit.measure import (
        greedy_accuracy,
        mismatch,
        sampled_reward,
        sampling_config,
        score_samples,
    )
    from ais_lightning.toolkit.probes import engine_factory, training_engine

    sampled = sampling_config(
        policy.tokenizer, args.samples, args.temperature, args.max_new_tokens, args.seed
    )
    overrides = config_overrides(args)
    rows = []
    for remasking in args.remasking.split(","):
        for precision in args.precisions.split(","):
            factory = engine_factory(
                overrides,
                precision=precision,
                remasking=remasking,
                block_length=args.block_length,
                steps=args.denoise_steps,
            )
            engine = training_engine(policy, factory)
            # seeded: random remasking draws its positions even when greedy
            acc = greedy_accuracy(policy, engine, task, samples, args.max_new_tokens, seed=args.seed)
            batch, pi = score_samples(policy, engine, samples, sampled)
            mu, mask = batch.rollout_logprobs, batch.response_mask
            row = {
                "remasking": remasking,
                "precision": precision,
                "greedy_accuracy": acc,
                **mismatch(pi, mu, mask, batch.prompt_index),
                "sampled_reward": sampled_reward(task, samples, batch, policy.tokenizer),
            }
            if remasking == "low_confidence" and args.selection:
                row.update(selection_analysis(policy, engine, batch, args.temperature))
            rows.append(row)
            print(
                f"{remasking:>14} {precision:>5}: greedy acc {row['greedy_accuracy']:.3f}  KL k3 {row['kl_k3']:.2e}  "
                f"k1 {row['kl_k1']:.2e}  max|dlogp| {row['max_abs_dlogp']:.2e}  reward {row['sampled_reward']:.3f}",
                flush=True,
            )
    return rows


def _quantiles(x: torch.Tensor) -> dict[str, float]:
    x = x.abs().double()
    return {
        "mean": float(x.mean()),
        "p99": float(x.quantile(0.99)),
        "max": float(x.max()),
    }


def selection_analysis(policy, engine, batch, temperature: float) -> dict[str, Any]:
    """Per-sequence log-ratios log pi - log mu of the whole low-confidence trajectory (every canvas token,
    the tail too), split into the token factors (what the correctors use) and the position-selection
    factor (``low_confidence_selection_logprobs`` under the fp32 policy and under the engine's model)."""
    import dataclasses

    from ais_lightning.policy.diffusion import low_confidence_selection_logprobs

    canvas = batch.extras["canvas_ids"]
    everything = dataclasses.replace(
        batch,
        response_ids=canvas,
        response_mask=torch.ones_like(canvas, dtype=torch.bool),
        rollout_logprobs=batch.extras["canvas_logprobs"],
    )
    with torch.no_grad():
        pi_tok = policy.batch_logprobs(everything, temperature=temperature).logprobs
    d_tok = (pi_tok - everything.rollout_logprobs).sum(-1)  # [B]
    schedule = engine.schedule(canvas.shape[1])
    sel_pi = low_confidence_selection_logprobs(policy.model, batch, schedule, temperature).sum(-1)  # [B]
    sel_mu = low_confidence_selection_logprobs(engine.model, batch, schedule, temperature).sum(-1)  # [B]
    d_sel = sel_pi - sel_mu  # [B]
    finite = torch.isfinite(d_sel)
    tok, sel = _quantiles(d_tok), _quantiles(d_sel[finite]) if bool(finite.any()) else {}
    return {
        "seq_dlogp_tokens": tok,
        "seq_dlogp_selection": sel,
        "selection_nonfinite": int((~finite).sum()),
        "selection_dominates_frac": float((d_sel[finite].abs() > d_tok[finite].abs()).float().mean()),
        "selection_logprob_mu_mean": float(sel_mu.mean()),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| remasking | precision | greedy accuracy | KL k3 (± s.e.) | KL k1 | max abs dlogp | sampled reward |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['remasking']} | {r['precision']} | {r['greedy_accuracy']:.3f} | {r['kl_k3']:.2e} ± {r['kl_k3_se']:.1e} | "
            f"{r['kl_k1']:.2e} | {r['max_abs_dlogp']:.2e} | {r['sampled_reward']:.3f} |"
        )
    sel = [r for r in rows if "seq_dlogp_selection" in r]
    if sel:
        lines += [
            "",
            "Low-confidence trajectories, per-sequence |log pi - log mu| (all canvas positions):",
            "",
            "| precision | tokens: mean | p99 | max | selection: mean | p99 | max | selection larger | "
            "mean log P_mu(selection) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in sel:
            t, s = r["seq_dlogp_tokens"], r["seq_dlogp_selection"]
            lines.append(
                f"| {r['precision']} | {t['mean']:.3f} | {t['p99']:.3f} | {t['max']:.3f} | {s.get('mean', math.nan):.3f} | "
                f"{s.get('p99', math.nan):.3f} | {s.get('max', math.nan):.3f} | {r['selection_dominates_frac']:.2f} | "
                f"{r['selection_logprob_mu_mean']:.2f} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ais_lightning.toolkit.probes import add_overrides_argument

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt for the KL")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=8, help="response canvas length (also the SFT's)")
    p.add_argument("--denoise-steps", type=int, default=None, help="engine steps (default: one per token)")
    p.add_argument("--block-length", type=int, default=None, help="semi-autoregressive block (default: none)")
    p.add_argument("--remasking", default="low_confidence,random")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--selection",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="low_confidence: also measure the position-selection factor of the trajectory ratio",
    )
    p.add_argument("--load", default=None, help="warm-started weights to load instead of the SFT")
    p.add_argument("--save", default=None, help="write the warm-started weights here")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    add_overrides_argument(p)
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from ais_lightning.tasks import PromptDataModule
    from ais_lightning.toolkit.probes import compose, write_json

    cfg, c = compose(config_overrides(args))
    task, policy = c.task, c.policy.build(cfg.seed)
    data = PromptDataModule(
        task,
        train_size=max(args.sft_steps, 1) * args.batch_size,
        val_size=args.eval_prompts,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    losses: list[float] = []
    t0 = time.perf_counter()
    if args.load:
        policy.model.load_state_dict(torch.load(args.load, map_location="cpu", weights_only=True))
    else:
        losses = sft(policy, data, args.sft_steps, args.lr, args.seed)
    sft_seconds = time.perf_counter() - t0
    if args.save:
        torch.save(policy.model.state_dict(), args.save)
    rows = measure(policy, task, data.val_samples(), args)
    result = {
        "args": vars(args),
        "sft_seconds": sft_seconds,
        "sft_loss_first_last_50": [
            sum(losses[:50]) / max(len(losses[:50]), 1),
            sum(losses[-50:]) / max(len(losses[-50:]), 1),
        ],
        "rows": rows,
    }
    print(markdown(rows))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
