"""Importance ratios under truncated sampling (top-p, top-k, min-p): no replay, the trainer's own filter, replay.

The policy, the task and the engines come from the composed ``ais-train`` config (``ais_lightning.toolkit.probes``:
the same overrides as ``ais-train``, e.g. ``policy=smollm2``). For each rollout precision of ``--precisions`` and
each truncation of ``--truncations`` (``;``-separated, e.g. ``top_p=0.9;top_k=20``), one engine built as training
builds it samples ``--prompts`` prompts x ``--samples`` per seed of ``--seeds`` at ``--temperature``, and the policy
scores every sampled token three ways against the engine's log mu (renormalized over the set the engine kept):

- ``none``: pi over the whole vocabulary (the batch without its support): log pi - log mu = log(pi / mu) + log mu(S);
- ``trainer``: NeMo-RL's trainer-side filter, pi renormalized over the set the *trainer's own* logits keep
  (``truncation_mask`` of the policy's tempered logits, as NeMo-RL's ``apply_top_k_top_p``). A sampled token outside
  that set has log pi = -inf there: ``outside`` counts them, the statistics are over the other tokens;
- ``replay``: pi renormalized over the engine's recorded set (``RolloutBatch.support``, what training does).

Per row: the mismatch diagnostics of training (``MismatchDiagnostics`` at C = 2: k3 and k1 KL, ratio mean, the
fractions above 2 and below 1/2, the largest |log ratio|, NeMo-RL's token_mult_prob_error), the mean kept-set size
and the support's bytes per response position. The table of docs/correctors.md::

    python tools/truncation_replay.py --warm-start --json replay_tiny.json
    python tools/truncation_replay.py --prompts 8 --json replay_smollm2.json policy=smollm2

``--grpo`` trains instead: a GRPO run of ``--batches`` rollout steps (``ais-train``'s loop, one process, from its
warm start) with replay, which at every step also runs a copy of the corrector on the same batch scored without
replay, and prints both: the corrector's lambda, mean weight and clipped fraction, the mean |difference| of the
token weights, and k3::

    python tools/truncation_replay.py --grpo --batches 30 algorithm.top_p=0.9 corrector=ais
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
from typing import Any

import torch

PRECISIONS = "int8,fp8"
"""Default rollout precisions (``rollout.precision``)."""
TRUNCATIONS = "top_p=0.9;top_k=20"
"""Default truncations: ``;``-separated, each ``key=value[,key=value]`` of ``top_p``, ``top_k``, ``min_p``."""
STATS = {
    "kl_k3": "kl_k3",
    "kl_k1": "kl_k1",
    "ratio_mean": "ratio_mean",
    "frac_above_2": "ratio_frac_above",
    "frac_below_half": "ratio_frac_below",
    "max_abs_log_ratio": "abs_log_ratio_max",
    "token_mult_prob_error": "token_mult_prob_error",
}
"""Reported name -> ``MismatchDiagnostics`` metric (C = 2)."""
SCORINGS = ("none", "trainer", "replay")


def parse_truncation(spec: str) -> dict[str, float | int]:
    """``"top_p=0.9,top_k=20"`` -> ``{"top_p": 0.9, "top_k": 20}``; ValueError on another key."""
    out: dict[str, float | int] = {}
    for part in spec.split(","):
        key, _, value = part.strip().partition("=")
        if key not in ("top_p", "top_k", "min_p") or not value:
            raise ValueError(f"truncation {spec!r}: expected top_p=P, top_k=K or min_p=M, comma-separated")
        out[key] = int(value) if key == "top_k" else float(value)
    return out


@torch.no_grad()
def trainer_side_logprobs(
    policy: Any, batch: Any, temperature: float, truncation: dict[str, Any], rows: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeMo-RL's trainer-side filter: ``(log pi [B, T], inside [B, T] bool)`` with pi renormalized over the set the
    policy's own tempered logits keep (-inf where the sampled token is outside it; 0 where masked). One full forward
    of ``rows`` rows at a time (its ``[rows, P + T, V]`` logits)."""
    from ais_lightning.policy.scoring import build_sequences
    from ais_lightning.rollout.sampling import truncation_mask

    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
    inside = torch.zeros(batch.response_ids.shape, dtype=torch.bool)
    plen = batch.prompt_ids.shape[1]
    for start in range(0, batch.response_ids.shape[0], rows):
        part = batch.rows(torch.arange(start, min(start + rows, batch.response_ids.shape[0])))
        ids, attention, positions = build_sequences(
            part.prompt_ids, part.prompt_mask, part.response_ids, part.response_mask
        )
        logits = policy.model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
        mask = part.response_mask
        scaled = logits[:, plen - 1 : -1][mask].float() / temperature  # [n, V]
        keep = truncation_mask(scaled, **truncation)
        logp = scaled.masked_fill(~keep, float("-inf")).log_softmax(-1)  # [n, V]
        picked = logp.gather(-1, part.response_ids[mask][:, None]).squeeze(-1)  # [n]
        out[start : start + mask.shape[0]][mask] = picked
        inside[start : start + mask.shape[0]][mask] = torch.isfinite(picked)
    return out, inside


def mismatch_stats(pi: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """:data:`STATS` of log pi against log mu over ``mask``, as training logs them."""
    from ais_lightning.diagnostics import MismatchDiagnostics

    metrics = MismatchDiagnostics(prefix="")
    metrics.update(torch.where(mask, pi, 0.0), mu, mask, entropy=torch.ones_like(mu))
    values = metrics.compute()
    return {name: float(values[key]) for name, key in STATS.items()}


def score_three_ways(
    policy: Any, batch: Any, temperature: float, truncation: dict[str, Any]
) -> dict[str, Any]:
    """The statistics of one sampled batch under each of :data:`SCORINGS`, the outside fraction and the support's
    size (see the module docstring)."""
    mask, mu = batch.response_mask, batch.rollout_logprobs
    with torch.no_grad():
        none = policy.batch_logprobs(dataclasses.replace(batch, support=None), temperature).logprobs
        replay = policy.batch_logprobs(batch, temperature).logprobs
    trainer, inside = trainer_side_logprobs(policy, batch, temperature, truncation)
    tokens = int(mask.sum())
    counts = batch.support.counts[mask].float()
    return {
        "tokens": tokens,
        "none": mismatch_stats(none, mu, mask),
        "trainer": mismatch_stats(trainer, mu, mask & inside),
        "replay": mismatch_stats(replay, mu, mask),
        "outside": float((mask & ~inside).sum()) / max(tokens, 1),
        "kept_mean": float(counts.mean()),
        "kept_max": int(counts.max()),
        "support_bytes_per_position": batch.support.num_bytes / mask.numel(),
    }


def measure(policy: Any, c: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (precision, truncation): the per-seed results of :func:`score_three_ways` and their means; each
    row is written to ``--json`` as soon as it is measured."""
    from ais_lightning.rollout import SamplingConfig
    from ais_lightning.tasks import PromptDataModule
    from ais_lightning.toolkit.measure import stop_tokens
    from ais_lightning.toolkit.probes import engine_factory, training_engine, write_json

    rows = []
    for precision in args.precisions.split(","):
        engine = training_engine(policy, engine_factory(args.overrides, precision=precision))
        for spec in args.truncations.split(";"):
            truncation = parse_truncation(spec)
            per_seed = []
            for seed in (int(s) for s in args.seeds.split(",")):
                samples = PromptDataModule(c.task, val_size=args.prompts, seed=seed).val_samples()
                sampling = SamplingConfig(
                    n=args.samples, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                    stop_token_ids=stop_tokens(policy.tokenizer), seed=seed, **truncation,
                )  # fmt: skip
                batch = engine.generate(policy.encode_prompts([s.prompt for s in samples]), sampling)
                per_seed.append(score_three_ways(policy, batch, args.temperature, truncation))
            row = {"precision": precision, "truncation": spec, "per_seed": per_seed}
            for key in ("outside", "kept_mean", "support_bytes_per_position"):
                row[key] = statistics.fmean(r[key] for r in per_seed)
            for scoring in SCORINGS:
                row[scoring] = {k: statistics.fmean(r[scoring][k] for r in per_seed) for k in STATS}
            rows.append(row)
            write_json(args.json, {"args": vars(args), "rows": rows})  # what is done so far survives a stop
            print(
                f"{precision:>5} {spec:>17}: k3 none {row['none']['kl_k3']:.2e}  trainer {row['trainer']['kl_k3']:.2e} "
                f"(outside {row['outside']:.2%})  replay {row['replay']['kl_k3']:.2e}",
                flush=True,
            )
        del engine
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """One line per (precision, truncation, scoring)."""
    lines = [
        "| rollout | truncation | pi over | KL k3 | KL k1 | ratio mean | w > 2 | w < 1/2 | max abs log w | "
        "token_mult_prob_error | sampled tokens outside | kept set (mean) | support bytes / position |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    label = {"none": "whole vocabulary", "trainer": "trainer's own set", "replay": "engine's set (replay)"}
    for r in rows:
        for scoring in SCORINGS:
            s = r[scoring]
            outside = f"{r['outside']:.2%}" if scoring == "trainer" else "0"
            lines.append(
                f"| `{r['precision']}` | `{r['truncation']}` | {label[scoring]} | {s['kl_k3']:.2e} | {s['kl_k1']:.2e} | "
                f"{s['ratio_mean']:.4f} | {s['frac_above_2']:.4f} | {s['frac_below_half']:.4f} | "
                f"{s['max_abs_log_ratio']:.3f} | {s['token_mult_prob_error']:.4f} | {outside} | "
                f"{r['kept_mean']:.1f} | {r['support_bytes_per_position']:.0f} |"
            )
    return "\n".join(lines)


def replay_probe_class() -> type:
    """A ``GRPOModule`` that trains with replay and, at every rollout step, runs a copy of its corrector on the
    same batch scored without replay; ``records`` keeps both per step."""
    from ais_lightning.modules.grpo import GRPOModule
    from ais_lightning.ops import log_ratio, masked_mean

    class ReplayProbe(GRPOModule):
        records: list[dict[str, float]]

        def build_experience(self, batch, prompts, fields, *args, **kwargs):
            exp, stats = super().build_experience(batch, prompts, fields, *args, **kwargs)
            if exp is None or batch.support is None:
                return exp, stats
            mask = batch.response_mask  # every valid token
            temperature = self.sampling.temperature
            with torch.no_grad():
                raw = self.policy.batch_logprobs(
                    dataclasses.replace(batch, support=None), temperature, compute_entropy=True
                )
            corrector = copy.deepcopy(self.corrector)  # its state (an EMA) stays the run's
            out = corrector.from_log_ratio(
                log_ratio(raw.logprobs, batch.rollout_logprobs, mask), mask, advantages=exp.advantages,
                entropy=raw.entropy, train_logprobs=raw.logprobs, rollout_logprobs=batch.rollout_logprobs,
                impurity=raw.impurity,
            )  # fmt: skip
            record = {
                "step": len(self.records),
                "weight_mean_replay": float(masked_mean(exp.weights, mask)),
                "weight_mean_none": float(masked_mean(out.weights, mask)),
                "weight_abs_diff": float(masked_mean((exp.weights - out.weights).abs(), mask)),
                "clipped_replay": stats.get("corrector/clipped_frac", float("nan")),
                "clipped_none": out.stats.get("corrector/clipped_frac", float("nan")),
                "lambda_replay": stats.get("ais/lambda", float("nan")),
                "lambda_none": out.stats.get("ais/lambda", float("nan")),
                "kl_k3_replay": stats.get("ais/kl_k3", float("nan")),
                "kl_k3_none": out.stats.get("ais/kl_k3", float("nan")),
                "reward": stats["reward/mean"],
            }
            self.records.append(record)
            return exp, stats

    return ReplayProbe


def grpo(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--grpo`` run (module docstring)."""
    from ais_lightning.toolkit.probes import quiet_run_logs, run_probe

    quiet_run_logs()
    probe_class = replay_probe_class()
    probe_class.records = []
    run = run_probe(args.overrides, args.batches, args.seed, probe_class, "truncation_replay")
    records = probe_class.records
    keys = [k for k in records[0] if k != "step"]
    means = {k: statistics.fmean(r[k] for r in records) for k in keys}
    return {"seconds": run.seconds, "steps": records, "mean": means}


def grpo_markdown(result: dict[str, Any]) -> str:
    pairs = [("lambda", "AIS lambda"), ("weight_mean", "mean token weight"), ("clipped", "clipped fraction"),
             ("kl_k3", "k3 (the corrector's)")]  # fmt: skip
    m = result["mean"]
    lines = [
        "| over the run's steps | with replay (what trained) | same batches without replay |",
        "| --- | ---: | ---: |",
    ]
    for key, name in pairs:
        lines.append(f"| {name} | {m[key + '_replay']:.4g} | {m[key + '_none']:.4g} |")
    lines.append(f"| mean abs difference of the token weights | {m['weight_abs_diff']:.4g} | |")
    lines.append(f"| reward (mean over steps) | {m['reward']:.3f} | |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ais_lightning.toolkit.probes import add_overrides_argument

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precisions", default=PRECISIONS, help="comma-separated rollout precisions")
    p.add_argument(
        "--truncations", default=TRUNCATIONS, help="';'-separated, e.g. 'top_p=0.9;top_k=20,top_p=0.9'"
    )
    p.add_argument("--seeds", default="0,1", help="comma-separated: one prompt draw and sampling seed each")
    p.add_argument("--prompts", type=int, default=16, help="prompts per seed")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: algorithm.max_new_tokens")
    p.add_argument(
        "--warm-start", action="store_true", help="score the policy a run starts from (its warm start)"
    )
    p.add_argument(
        "--grpo", action="store_true", help="a GRPO run comparing the corrector with and without replay"
    )
    p.add_argument("--batches", type=int, default=30, help="--grpo: rollout steps")
    p.add_argument("--seed", type=int, default=0, help="--grpo: the run's seed")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", default=None, help="write every number here")
    add_overrides_argument(p)
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    from ais_lightning.toolkit.probes import compose, write_json

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.grpo:
        result = grpo(args)
        print(grpo_markdown(result))
        write_json(args.json, {"args": vars(args), **result})
        return 0
    cfg, c = compose(args.overrides)
    if args.max_new_tokens is None:
        args.max_new_tokens = c.algorithm.max_new_tokens
    if args.warm_start:
        policy, _ = c.initial_policy(cfg.seed, progress_bar=True)
    else:
        policy = c.policy.build(cfg.seed)
    policy.eval()
    print(
        f"policy {cfg.policy._target_}, task {type(c.task).__name__}, torch threads {torch.get_num_threads()}"
    )
    rows = measure(policy, c, args)  # writes --json row by row
    print()
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
