"""Rollout mismatch and greedy accuracy of every rollout precision on any ``ais-train`` policy and task.

The policy and the task come from the composed ``ais-train`` config (overrides after ``--``, e.g.
``-- policy=smollm2 task=arithmetic``; ``ais_lightning.build.validate``), so a real model is measured with
the prompts it is trained on (its chat template and the task's chat format included). Per rollout precision
(``--precisions``: a ``TorchRolloutEngine`` precision, optionally ``@F`` for ``outlier_fraction=F``, e.g.
``int8@0`` = int8 without outlier channels), one engine is built from the policy and, per seed of ``--seeds``
(each draws its own ``--prompts`` prompts and sampling noise), as in training:

1. ``--samples`` samples per prompt at ``--temperature`` (``--max-new-tokens``, stopped at EOS): the engine's
   log mu of each sampled token, the fp32 policy's log pi of the same tokens (``Policy.batch_logprobs``), the
   token-mean k3 KL(mu || pi) (``MismatchKL("k3")``'s estimate) with its standard error over prompts (the
   tokens of one prompt are one cluster, :func:`clustered_kl`), and the largest ``|log pi - log mu|``;
2. a weight sync of the policy's own weights (``sync_weights(Policy.full_state_dict())``, timed): the step at
   which the engine re-picks its outlier channels from what its prefills saw.

Then the greedy accuracy of the engine on ``--eval-prompts`` held-out prompts (``algorithm.max_new_tokens``
new tokens unless ``--eval-max-new-tokens``). Prints a markdown table (KL: mean over seeds and the spread of
the per-seed values), ``--json`` writes every number. Example (docs/real_model.md)::

    python tools/model_mismatch.py --json smollm2_kl.json -- policy=smollm2 task=arithmetic
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

PRECISIONS = "fp32,bf16,int8,int8@0,fp8,fp8@0,fp4"
"""Default precisions: the trainer's own (fp32, should give ~0), bf16, int8 and fp8 with and without their
default outlier channels, fp4 (NVFP4)."""


def clustered_kl(
    pi: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, prompt_index: torch.Tensor
) -> tuple[float, float]:
    """Token-mean k3 KL and its standard error with the tokens of one prompt as one cluster.

    ``pi``, ``mu``: ``[B, T]`` log-probs; ``mask``: ``[B, T]`` bool; ``prompt_index``: ``[B]`` prompt of each row.
    The mean equals ``MismatchKL("k3")`` (same clamp of the log-ratio). With ``s_p`` the k3 sum and ``n_p`` the
    token count of prompt ``p`` (of ``P`` prompts with tokens): ``KL = sum s_p / sum n_p`` and
    ``s.e. = sqrt(P / (P - 1) * sum_p (s_p - KL n_p)^2) / sum_p n_p`` (the ratio estimator's linearised s.e.).
    """
    from ais_lightning.ops import log_ratio

    delta = log_ratio(pi, mu, mask).double()  # [B, T], 0 where masked
    k3 = torch.where(mask, (torch.expm1(delta) - delta).clamp(min=0.0), torch.zeros_like(delta))
    prompts = int(prompt_index.max()) + 1
    s = torch.zeros(prompts, dtype=torch.float64).index_add_(0, prompt_index, k3.sum(-1))  # [P]
    n = torch.zeros(prompts, dtype=torch.float64).index_add_(0, prompt_index, mask.sum(-1).double())  # [P]
    keep = n > 0
    s, n = s[keep], n[keep]
    total = float(n.sum())
    if total == 0:
        return 0.0, float("nan")
    kl = float(s.sum()) / total
    p = int(keep.sum())
    se = math.sqrt(p / max(p - 1, 1) * float(((s - kl * n) ** 2).sum())) / total
    return kl, se


def parse_precision(spec: str) -> tuple[str, dict[str, Any]]:
    """``"int8@0.1"`` -> ``("int8", {"outlier_fraction": 0.1})``; ``"fp8"`` -> ``("fp8", {})``."""
    precision, _, fraction = spec.partition("@")
    return precision, ({"outlier_fraction": float(fraction)} if fraction else {})


def task_rewards(task, samples, batch, tokenizer) -> list[float]:
    """Task rewards of every row of ``batch`` (row ``i`` answers ``samples[batch.prompt_index[i]]``)."""
    from ais_lightning.tasks import batch_rewards

    return batch_rewards(task, samples, batch, tokenizer)[0]


def sample_mismatch(policy, engine, task, samples, sampling) -> dict[str, Any]:
    """Sample ``samples``' prompts with ``engine`` and compare its log mu with the fp32 ``policy``'s log pi."""
    batch = engine.generate(policy.encode_prompts([s.prompt for s in samples]), sampling)
    mu, mask = batch.rollout_logprobs, batch.response_mask
    with torch.no_grad():
        pi = policy.batch_logprobs(batch, temperature=sampling.temperature).logprobs
    kl, se = clustered_kl(pi, mu, mask, batch.prompt_index)
    rewards = task_rewards(task, samples, batch, policy.tokenizer)
    return {
        "kl_k3": kl,
        "kl_k3_se": se,
        "max_abs_dlogp": float((pi - mu)[mask].abs().max()) if bool(mask.any()) else 0.0,
        "tokens": int(mask.sum()),
        "sampled_reward": sum(rewards) / len(rewards),
    }


def greedy_accuracy(policy, engine, task, samples, max_new_tokens: int) -> float:
    """Fraction of ``samples`` the engine answers right greedily (reward 1)."""
    from ais_lightning.rollout import SamplingConfig

    stop = [policy.tokenizer.eos_token_id] if policy.tokenizer.eos_token_id is not None else []
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop)
    batch = engine.generate(policy.encode_prompts([s.prompt for s in samples]), greedy)
    rewards = task_rewards(task, samples, batch, policy.tokenizer)
    return sum(r >= 1.0 - 1e-6 for r in rewards) / len(rewards)


def measure(policy, task, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every precision of ``args.precisions``: the mismatch per seed, the sync time, the greedy accuracy."""
    from ais_lightning.rollout import SamplingConfig, TorchRolloutEngine
    from ais_lightning.tasks import PromptDataModule

    stop = [policy.tokenizer.eos_token_id] if policy.tokenizer.eos_token_id is not None else []
    seeds = [int(s) for s in args.seeds.split(",")]
    draws = {seed: PromptDataModule(task, val_size=args.prompts, seed=seed).val_samples() for seed in seeds}
    held_out = PromptDataModule(task, val_size=args.eval_prompts, seed=args.eval_seed).val_samples()
    rows = []
    for spec in args.precisions.split(","):
        precision, extra = parse_precision(spec)
        t0 = time.perf_counter()
        engine = TorchRolloutEngine(policy.model, precision=precision, **extra)
        build = time.perf_counter() - t0
        per_seed, syncs = [], []
        for seed in seeds:
            sampling = SamplingConfig(
                n=args.samples,
                temperature=args.temperature,
                max_new_tokens=args.max_new_tokens,
                stop_token_ids=stop,
                seed=seed,
            )
            per_seed.append(sample_mismatch(policy, engine, task, draws[seed], sampling))
            t1 = time.perf_counter()
            engine.sync_weights(policy.full_state_dict())
            syncs.append(time.perf_counter() - t1)
        kls = [r["kl_k3"] for r in per_seed]
        row = {
            "precision": spec,
            "backend": engine.backend,
            "outlier_fraction": engine.outlier_fraction,
            "kl_k3": statistics.fmean(kls),
            "kl_k3_min": min(kls),
            "kl_k3_max": max(kls),
            "kl_k3_se": math.sqrt(sum(r["kl_k3_se"] ** 2 for r in per_seed)) / len(per_seed),
            "max_abs_dlogp": max(r["max_abs_dlogp"] for r in per_seed),
            "sampled_reward": statistics.fmean(r["sampled_reward"] for r in per_seed),
            "greedy_accuracy": greedy_accuracy(policy, engine, task, held_out, args.eval_max_new_tokens),
            "build_s": build,
            "sync_s": statistics.median(syncs),
            "per_seed": per_seed,
        }
        rows.append(row)
        print(
            f"{spec:>10}: KL k3 {row['kl_k3']:.2e} (seeds {row['kl_k3_min']:.1e}..{row['kl_k3_max']:.1e}, s.e. "
            f"{row['kl_k3_se']:.1e})  max |dlogp| {row['max_abs_dlogp']:.2f}  greedy acc {row['greedy_accuracy']:.3f}"
            f"  build {build:.1f} s  sync {row['sync_s']:.2f} s",
            flush=True,
        )
        del engine
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| precision | outlier channels | KL k3 (mean over seeds) | per-seed range | s.e. | max abs dlogp | "
        "greedy accuracy | sampled reward | build s | sync s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| `{r['precision']}` | {r['outlier_fraction']:g} | {r['kl_k3']:.2e} | {r['kl_k3_min']:.1e} .. "
            f"{r['kl_k3_max']:.1e} | {r['kl_k3_se']:.1e} | {r['max_abs_dlogp']:.2f} | {r['greedy_accuracy']:.3f} | "
            f"{r['sampled_reward']:.3f} | {r['build_s']:.1f} | {r['sync_s']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog="After --: ais-train overrides (policy=..., task=...)."
    )
    p.add_argument("--precisions", default=PRECISIONS, help="comma-separated; precision[@outlier_fraction]")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated: one prompt draw and sampling seed each")
    p.add_argument("--prompts", type=int, default=16, help="prompts per seed")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts for the greedy accuracy")
    p.add_argument("--eval-seed", type=int, default=1000, help="seed of the held-out prompt draw")
    p.add_argument("--eval-max-new-tokens", type=int, default=None, help="default: algorithm.max_new_tokens")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", default=None, help="write every number here")
    args = p.parse_args(argv)
    args.overrides = overrides
    return args


def main(argv: list[str] | None = None) -> int:
    from ais_lightning.build import validate
    from ais_lightning.config import compose_train_config

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = compose_train_config(["output_dir=unused", *args.overrides])
    c = validate(cfg)
    if args.eval_max_new_tokens is None:
        args.eval_max_new_tokens = c.algorithm.max_new_tokens
    policy = c.policy.build(cfg.seed).eval()
    print(
        f"policy {cfg.policy._target_} ({sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M), task "
        f"{type(c.task).__name__} format {getattr(c.task, 'format', '-')}, torch threads {torch.get_num_threads()}"
    )
    rows = measure(policy, c.task, args)
    print()
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
