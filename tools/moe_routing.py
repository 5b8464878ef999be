"""Mismatch KL and routing disagreement of quantized mixture-of-experts rollouts, with and without routing replay.

On the built-in tiny Qwen3-MoE (``policy=tiny_qwen3_moe``: 8 experts, top-2), either as initialised
(``--sft-steps 0``) or after a short supervised warm start on the task (``Policy.sft_loss``, AdamW; default 2-digit
addition), for every rollout precision of the torch engine given (``rollout.precision``, default int8, fp8, fp4;
quantized experts, ``ais_lightning.quant.QuantExperts``): the engine samples ``--prompts`` task prompts x ``--n``
at T = 1 and records its routing; the fp32 trainer scores the samples without and with rollout routing replay
(the same weights under ``policy.router_replay=true``). The policy, the task and the engines are built as
``ais-train`` builds them, from the config composed of ``policy=tiny_qwen3_moe`` and any ``ais-train`` overrides
given (``ais_lightning.toolkit.probes.compose``, e.g. ``policy.overrides.num_experts=16 task.digits=3``). Reported per
precision, mean over ``--seeds``:

- **k3 (none / R3)**: the mismatch KL estimate ``E[w - 1 - log w]``, ``w = pi / mu`` over valid response tokens
  (``ais_lightning.diagnostics.MismatchKL("k3")``), with the trainer routing by itself / replaying the engine's
  experts;
- **disagree**: ``RoutingDisagreement``, the fraction of (token, MoE layer) pairs where the trainer's own top-2
  set differs from the engine's (what replay removes: with replay the trainer uses the engine's experts on every
  replayed token, so that rate is 0);
- **tokens with >= 1 layer differing**: the fraction of replayed positions where any layer disagrees.

Usage: PYTHONPATH=. .venv/bin/python tools/moe_routing.py [--precisions int8,fp8,fp4] [--prompts 32] [--n 4]
[--max-new-tokens 16] [--seeds 0,1] [--sft-steps 0] [--threads 1] [OVERRIDES...]. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

import torch

from ais_lightning.diagnostics import MismatchKL, RoutingDisagreement
from ais_lightning.models.routing import routing_replay_mask
from ais_lightning.ops import pad_sequences, topk_sets_differ
from ais_lightning.policy import Policy
from ais_lightning.rollout.base import SamplingConfig

POLICY = ["policy=tiny_qwen3_moe"]
"""The ``ais-train`` overrides every run of this tool starts from."""


def warm_start(policy: Policy, task: Any, steps: int, seed: int, batch: int = 64, lr: float = 3e-3) -> float:
    """``steps`` AdamW steps of the SFT loss on ``task``'s reference solutions; returns the last loss."""
    if steps <= 0:
        return float("nan")
    tok, rng = policy.tokenizer, random.Random(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        samples = [task.sample(rng) for _ in range(batch)]
        prompts = [tok.encode(s.prompt) for s in samples]
        answers = [tok.encode(s.solution) + [tok.eos_token_id] for s in samples]
        p_ids, p_mask = pad_sequences(prompts, tok.pad_token_id, "left")
        r_ids, r_mask = pad_sequences(answers, tok.pad_token_id, "right")
        loss = policy.sft_loss(p_ids, p_mask, r_ids, r_mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def measure(
    policy: Policy,
    replayed: Policy,
    engine: Callable[..., Any],
    prompts: list[list[int]],
    sampling: SamplingConfig,
) -> dict[str, float]:
    """One precision: ``engine(policy.model)`` samples ``prompts``; ``policy`` scores them routing by itself and
    ``replayed`` (the same weights, ``router_replay`` on) replaying the engine's experts."""
    batch = engine(policy.model).generate(prompts, sampling)
    mask = batch.response_mask
    valid = routing_replay_mask(batch.prompt_mask, batch.response_mask)
    out: dict[str, float] = {}
    for name, scorer in (("none", policy), ("r3", replayed)):
        with torch.no_grad():
            lp = scorer.batch_logprobs(batch).logprobs
        kl = MismatchKL("k3")
        kl.update(lp, batch.rollout_logprobs, mask)
        out[f"k3_{name}"] = float(kl.compute())
        own, used = scorer.routing_replay.last_routing()
        disagreement = RoutingDisagreement()
        disagreement.update(batch.routing, own, valid)
        out[f"disagree_{name}"] = float(disagreement.compute())
        out[f"used_differs_{name}"] = float(
            topk_sets_differ(used, batch.routing.long())[valid].float().mean()
        )
        out[f"token_any_{name}"] = float(
            topk_sets_differ(own, batch.routing.long()).any(-1)[valid].float().mean()
        )
    return out


def main(argv: list[str] | None = None) -> None:
    from ais_lightning.toolkit.probes import add_overrides_argument, compose, engine_factory, policy_like

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precisions", default="int8,fp8,fp4")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--sft-steps", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    add_overrides_argument(parser)
    args = parser.parse_intermixed_args(argv)
    torch.set_num_threads(args.threads)
    precisions = args.precisions.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    overrides = [*POLICY, "task.digits=2", *args.overrides]
    _, c = compose(overrides)
    engines = {p: engine_factory(overrides, precision=p) for p in precisions}
    replay_spec = compose([*overrides, "policy.router_replay=true"])[1].policy  # R3: the engine's experts
    rows: dict[str, list[dict[str, float]]] = {p: [] for p in precisions}
    sft_losses = []
    for seed in seeds:
        policy = c.policy.build(seed)
        sft_losses.append(warm_start(policy, c.task, args.sft_steps, seed))
        replayed = policy_like(replay_spec, policy, seed)
        rng = random.Random(1000 + seed)
        prompts = [policy.tokenizer.encode(c.task.sample(rng).prompt) for _ in range(args.prompts)]
        sampling = SamplingConfig(
            n=args.n,
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=[policy.tokenizer.eos_token_id],
            seed=seed,
        )
        for precision in precisions:
            rows[precision].append(measure(policy, replayed, engines[precision], prompts, sampling))
    print(
        f"tiny Qwen3-MoE, SFT steps {args.sft_steps} (last loss {sum(sft_losses) / len(sft_losses):.3f}), "
        f"{args.prompts} prompts x {args.n}, seeds {seeds}"
    )
    print()
    print(
        "| precision | k3 none | k3 R3 | disagree (token, layer) | tokens with a layer differing | R3: used != engine |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for precision, results in rows.items():
        mean = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
        print(
            f"| {precision} | {mean['k3_none']:.2e} | {mean['k3_r3']:.2e} | {mean['disagree_none']:.1%} | "
            f"{mean['token_any_none']:.1%} | {mean['used_differs_r3']:.1%} |"
        )


if __name__ == "__main__":
    main()
