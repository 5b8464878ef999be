"""What activation checkpointing buys the policy's update: saved activation memory and step time, one run.

For each setting (``policy.gradient_checkpointing`` false / true on top of a preset), the policy the
run would train is built from the same seed and runs the GRPO update's costly part, the log-prob pass
with autograd (entropy and impurity included, as the trainer computes them) and its backward, on one
batch of the preset's rollout shape (``prompts_per_step * group_size`` rows of prompt + response tokens
drawn from the vocabulary). Measured per setting:

- ``saved MB``: the activation memory autograd keeps for backward outside checkpointed regions: the
  distinct storages of the tensors it saves, parameters excluded (a ``saved_tensors_hooks`` count:
  exact, and the same on every run);
- ``peak MB``: the peak growth of the resident set size over the first forward + backward, in a fresh
  process per setting (sampled every 2 ms, ``ais_lightning.toolkit.measure.PeakRSS``; a process that has run the
  other setting would reuse its pages): saved activations plus gradients, the recomputation's transient
  activations and allocator slack;
- ``s``: wall time of forward + backward, and the paired ratio checkpointed / plain (per round, both
  settings back to back, the median over ``--repeats`` rounds and the range, as in the other tools).

    python tools/checkpoint_memory.py --config gemm --threads 2 --repeats 3
    python tools/checkpoint_memory.py --config tiny algorithm.max_new_tokens=32   # any ais-train override
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from ais_lightning.toolkit.measure import PeakRSS

CONFIGS = {"gemm": ["experiment=speed_gemm"], "tiny": ["experiment=smoke"]}
"""``ais-train`` overrides of each ``--config``: the ~105M GEMM-bound policy, or the 0.8M tiny one."""
SETTINGS = ("false", "true")
"""``policy.gradient_checkpointing`` values, plain first."""


def build_policy(config: str, checkpointing: str, extra: list[str]) -> tuple[Any, Any]:
    """The policy of the composed ``ais-train`` config (and the config's algorithm settings)."""
    from ais_lightning.toolkit.probes import compose

    cfg, c = compose([*CONFIGS[config], f"policy.gradient_checkpointing={checkpointing}", *extra])
    return c.policy.build(cfg.seed), c.algorithm


def make_batch(vocab: int, rows: int, prompt_len: int, response_len: int, seed: int = 0) -> tuple:
    """Token ids of a rollout-shaped batch: every prompt and response token valid."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (rows, prompt_len), generator=gen)
    response = torch.randint(0, vocab, (rows, response_len), generator=gen)
    return (
        prompt,
        torch.ones_like(prompt, dtype=torch.bool),
        response,
        torch.ones_like(response, dtype=torch.bool),
    )


def update_pass(policy: Any, batch: tuple) -> dict[str, float]:
    """One log-prob forward with autograd and its backward: saved activation MB, peak RSS growth MB, seconds."""
    params = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    storages: dict[int, int] = {}  # data pointer -> bytes of each distinct saved storage

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    policy.train()
    policy.model.zero_grad(set_to_none=True)
    gc.collect()
    with PeakRSS() as mem:
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = policy.response_logprobs(*batch, compute_entropy=True)
        (out.logprobs.sum() + 0.01 * out.entropy.sum()).backward()
        seconds = time.perf_counter() - start
    return {"saved_mb": sum(storages.values()) / 2**20, "peak_mb": mem.peak_delta / 2**20, "seconds": seconds}


def first_pass_peak_mb(args: argparse.Namespace, setting: str) -> float:
    """Peak RSS growth of the first update pass of ``setting`` in a fresh process (this script, --first-pass)."""
    cmd = [sys.executable, __file__, "--config", args.config, "--first-pass", setting, *args.overrides]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"])


def _policy_and_batch(config: str, setting: str, overrides: list[str]) -> tuple[Any, tuple, int]:
    policy, algo = build_policy(config, setting, overrides)
    vocab = policy.model.get_output_embeddings().weight.shape[0]
    rows = algo.prompts_per_step * algo.group_size
    return policy, make_batch(vocab, rows, 16, algo.max_new_tokens), algo.max_new_tokens


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from ais_lightning.toolkit.probes import add_overrides_argument, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="gemm")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of both settings, back to back")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--first-pass", choices=SETTINGS, default=None, help=argparse.SUPPRESS)
    add_overrides_argument(parser)
    args = parser.parse_intermixed_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.first_pass is not None:  # the child process of first_pass_peak_mb
        policy, batch, _ = _policy_and_batch(args.config, args.first_pass, args.overrides)
        print(json.dumps(update_pass(policy, batch)))
        return {}

    peaks = {s: first_pass_peak_mb(args, s) for s in SETTINGS}
    built = {s: _policy_and_batch(args.config, s, args.overrides) for s in SETTINGS}
    policies = {s: policy for s, (policy, _, _) in built.items()}
    _, batch, new_tokens = built[SETTINGS[0]]  # the same seed and shape for both settings
    rows = batch[0].shape[0]
    for s in SETTINGS:  # warm-up: allocator and kernels, not timed
        update_pass(policies[s], batch)
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for r in range(args.repeats):
        for s in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
            runs[s].append(update_pass(policies[s], batch))

    ratios = [c["seconds"] / p["seconds"] for p, c in zip(runs["false"], runs["true"])]
    rows_out = []
    for s in SETTINGS:
        rs = runs[s]
        rows_out.append(
            {
                "gradient_checkpointing": s == "true",
                "saved_mb": rs[0]["saved_mb"],
                "peak_mb": peaks[s],
                "seconds": statistics.median(x["seconds"] for x in rs),
            }
        )
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "batch": {"rows": rows, "prompt_tokens": 16, "response_tokens": new_tokens},
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "rows": rows_out,
        "time_ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "runs": runs,
    }
    plain, ckpt = rows_out
    print(f"{args.config}: {rows} rows x (16 + {new_tokens}) tokens, {result['threads']} threads")
    print("| gradient checkpointing | saved MB | peak RSS growth MB | s (median) |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows_out:
        print(
            f"| {row['gradient_checkpointing']} | {row['saved_mb']:.1f} | {row['peak_mb']:.0f} | {row['seconds']:.2f} |"
        )
    t = result["time_ratio"]
    print(
        f"saved activations {ckpt['saved_mb'] / plain['saved_mb']:.3f}x, peak {ckpt['peak_mb'] / plain['peak_mb']:.2f}x, "
        f"time {t['median']:.2f}x ({t['min']:.2f}-{t['max']:.2f}, paired)"
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
