"""Rollout mismatch and greedy accuracy of every rollout precision on any ``ais-train`` policy and task.

The policy, the task and the engines come from the composed ``ais-train`` config, built as ``ais-train`` builds
them (``ais_lightning.toolkit.probes.compose``: the same overrides as ``ais-train``, e.g. ``policy=smollm2
task=arithmetic``, also accepted after ``--``), so a real model is measured with the prompts it is trained on (its
chat template and the task's chat format included). Per rollout precision (``--precisions``: a rollout precision,
set as ``rollout.precision=`` on the composed rollout, optionally ``@F`` for ``rollout.outlier_fraction=F``, e.g.
``int8@0`` = int8 without outlier channels), one engine is built from the policy and, per seed of ``--seeds``
(each draws its own ``--prompts`` prompts and sampling noise), as in training:

1. ``--samples`` samples per prompt at ``--temperature`` (``--max-new-tokens``, stopped at EOS): the engine's
   log mu of each sampled token, the fp32 policy's log pi of the same tokens (``Policy.batch_logprobs``), the
   token-mean k3 KL(mu || pi) (``MismatchKL("k3")``) with its standard error over prompts (the tokens of one
   prompt are one cluster, ``ais_lightning.toolkit.measure.clustered_kl``), and the largest ``|log pi - log mu|``;
2. a weight sync of the policy's own weights (``sync_weights(Policy.full_state_dict())``, timed): the step at
   which the engine re-picks its outlier channels from what its prefills saw.

Then the greedy accuracy of the engine on ``--eval-prompts`` held-out prompts (``algorithm.max_new_tokens``
new tokens unless ``--eval-max-new-tokens``). Prints a markdown table (KL: mean over seeds and the spread of
the per-seed values), ``--json`` writes every number. Example (docs/real_model.md)::

    python tools/model_mismatch.py --json smollm2_kl.json policy=smollm2 task=arithmetic

``--check`` is the model-alignment check to run on a new model (docs/correctors.md): the run's own engines,
built as training builds them (``policy.fresh_model()`` + ``sync_weights``), at fp32 (the trainer-precision
copy; the torch engine if the rollout engine has none) and at the rollout precision of the composed config,
each scored as above plus NeMo-RL's ``token_mult_prob_error`` (``TokenMultProbError``), printed beside the
peers' acceptance thresholds (NeMo-RL ``token_mult_prob_error`` <= 1.05, ``docs/adding-new-models.md``;
prime-rl mean mismatch KL (k3) < 0.015, ``docs/development.md``) and this run's gate
``algorithm.max_fp32_mult_prob_error``. Exit status 1 when the fp32 engine misses a threshold: at fp32 both
sides compute the same model, so a miss is a bug in the model code, the weight sync or the log-prob
processing. The rollout row is the low-precision mismatch the corrector handles, for information::

    python tools/model_mismatch.py --check policy=smollm2 task=arithmetic rollout=fp8

``--matched`` measures the trainer and the engine at the *same* precision, each row with its own policy built with
``policy.dtype`` of that precision and carrying the measured weights (``ais_lightning.toolkit.probes.policy_like``), the
engine built from it as training builds it from a policy of ``policy.dtype``: ``PRECISION[:HEAD]`` with
``PRECISION`` in fp32 / bf16 / fp16 (``policy.dtype`` float32 / bfloat16 / float16 and ``rollout.precision`` that
precision) and ``HEAD`` the LM head's projection: ``model`` (default, the model dtype on both
sides), ``fp32`` (``policy.head_dtype=float32`` and ``rollout.head_dtype=float32``), ``fp32-engine`` or
``fp32-policy`` (fp32 on one side only, which ``ais-train`` warns about: measured to show why). ``--warm-start``
scores the policy a run starts from (the built-in model's cached SFT warm start) instead of its initial weights;
``--model-impl`` picks the engine's forward (its lean decode rounds differently from Hugging Face's at bf16/fp16).
The table of docs/correctors.md::

    python tools/model_mismatch.py --matched fp32,bf16,bf16:fp32,bf16:fp32-engine,fp16,fp16:fp32 --warm-start
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

import torch

PRECISIONS = "fp32,bf16,int8,int8@0,fp8,fp8@0,fp4"
"""Default precisions: the trainer's own (fp32, should give ~0), bf16, int8 and fp8 with and without their
default outlier channels, fp4 (NVFP4)."""

MATCHED = "fp32,bf16,bf16:fp32,bf16:fp32-engine,bf16:fp32-policy,fp16,fp16:fp32,fp16:fp32-engine"
"""Default ``--matched`` rows: each precision with the head in the model dtype and in fp32 on both sides, and the
one-sided fp32 heads the config check warns about."""
MATCHED_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``--matched`` precisions: the ``policy.dtype`` of each."""
MATCHED_HEADS = {
    "model": (False, False),
    "fp32": (True, True),
    "fp32-engine": (False, True),
    "fp32-policy": (True, False),
}
"""``--matched`` head options: (policy head fp32, engine head fp32)."""

THRESHOLDS = {
    "token_mult_prob_error": (1.05, "<=", "NeMo-RL"),
    "kl_k3": (0.015, "<", "prime-rl"),
}
"""The peers' acceptance of a new model: metric -> (threshold, comparison, peer). NeMo-RL investigates
``token_mult_prob_error`` above 1.05 "for equal precision" (``docs/adding-new-models.md``); prime-rl
merges a new model whose mean mismatch KL (k3, ``mismatch_kl``) over 20 steps stays below 0.015
(``docs/development.md``)."""


def passes(metric: str, value: float) -> bool:
    """Whether ``value`` of ``metric`` meets the peer's threshold of :data:`THRESHOLDS`."""
    threshold, op, _ = THRESHOLDS[metric]
    return value <= threshold if op == "<=" else value < threshold


def verdict(metric: str, value: float) -> str:
    """``"pass"`` or ``"FAIL"`` against the peer's threshold of ``metric``."""
    return "pass" if passes(metric, value) else "FAIL"


def parse_precision(spec: str) -> tuple[str, dict[str, Any]]:
    """``"int8@0.1"`` -> ``("int8", {"outlier_fraction": 0.1})``; ``"fp8"`` -> ``("fp8", {})``: the rollout settings
    of a ``--precisions`` entry."""
    precision, _, fraction = spec.partition("@")
    return precision, ({"outlier_fraction": float(fraction)} if fraction else {})


def sample_mismatch(policy, engine, task, samples, sampling) -> dict[str, Any]:
    """Sample ``samples``' prompts with ``engine`` and compare its log mu with the fp32 ``policy``'s log pi."""
    from ais_lightning.diagnostics import TokenMultProbError
    from ais_lightning.toolkit.measure import mismatch, sampled_reward, score_samples

    batch, pi = score_samples(policy, engine, samples, sampling)
    mu, mask = batch.rollout_logprobs, batch.response_mask
    mult = TokenMultProbError()
    mult.update(pi, mu, mask)
    return {
        **mismatch(pi, mu, mask, batch.prompt_index),
        "token_mult_prob_error": float(mult.compute()),
        "sampled_reward": sampled_reward(task, samples, batch, policy.tokenizer),
    }


def measure_engine(policy, task, args: argparse.Namespace, label: str, build_engine) -> dict[str, Any]:
    """One engine (``build_engine()``): the mismatch per seed of ``args.seeds``, sync time, greedy accuracy."""
    from ais_lightning.tasks import PromptDataModule
    from ais_lightning.toolkit.measure import greedy_accuracy, sampling_config

    seeds = [int(s) for s in args.seeds.split(",")]
    held_out = PromptDataModule(task, val_size=args.eval_prompts, seed=args.eval_seed).val_samples()
    t0 = time.perf_counter()
    engine = build_engine()
    build = time.perf_counter() - t0
    per_seed, syncs = [], []
    for seed in seeds:
        draw = PromptDataModule(task, val_size=args.prompts, seed=seed).val_samples()
        sampling = sampling_config(
            policy.tokenizer, args.samples, args.temperature, args.max_new_tokens, seed
        )
        per_seed.append(sample_mismatch(policy, engine, task, draw, sampling))
        t1 = time.perf_counter()
        engine.sync_weights(policy.full_state_dict())
        syncs.append(time.perf_counter() - t1)
    kls = [r["kl_k3"] for r in per_seed]
    row = {
        "precision": label,
        "backend": getattr(engine, "backend", None),
        "outlier_fraction": getattr(engine, "outlier_fraction", 0.0) or 0.0,
        "kl_k3": statistics.fmean(kls),
        "kl_k3_min": min(kls),
        "kl_k3_max": max(kls),
        "kl_k3_se": math.sqrt(sum(r["kl_k3_se"] ** 2 for r in per_seed)) / len(per_seed),
        "token_mult_prob_error": statistics.fmean(r["token_mult_prob_error"] for r in per_seed),
        "max_abs_dlogp": max(r["max_abs_dlogp"] for r in per_seed),
        "sampled_reward": statistics.fmean(r["sampled_reward"] for r in per_seed),
        "greedy_accuracy": greedy_accuracy(policy, engine, task, held_out, args.eval_max_new_tokens),
        "build_s": build,
        "sync_s": statistics.median(syncs),
        "per_seed": per_seed,
    }
    print(
        f"{label:>10}: KL k3 {row['kl_k3']:.2e} (seeds {row['kl_k3_min']:.1e}..{row['kl_k3_max']:.1e}, s.e. "
        f"{row['kl_k3_se']:.1e})  token_mult_prob_error {row['token_mult_prob_error']:.4f}  max |dlogp| "
        f"{row['max_abs_dlogp']:.2f}  greedy acc {row['greedy_accuracy']:.3f}  build {build:.1f} s  sync "
        f"{row['sync_s']:.2f} s",
        flush=True,
    )
    del engine
    return row


def measure(policy, task, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every precision of ``args.precisions`` on the composed rollout (see :func:`measure_engine`)."""
    from ais_lightning.toolkit.probes import engine_factory

    rows = []
    for spec in args.precisions.split(","):
        precision, extra = parse_precision(spec)
        factory = engine_factory(args.overrides, precision=precision, **extra)
        rows.append(measure_engine(policy, task, args, spec, lambda f=factory: f(policy.model)))
    return rows


def parse_matched(spec: str) -> tuple[str, bool, bool]:
    """``"bf16:fp32-engine"`` -> ``("bf16", False, True)``: the precision, and whether the policy's and the engine's
    LM head compute in fp32."""
    precision, _, head = spec.partition(":")
    head = head or "model"
    if precision not in MATCHED_DTYPES or head not in MATCHED_HEADS:
        raise ValueError(
            f"--matched row {spec!r}: PRECISION[:HEAD] with PRECISION in {list(MATCHED_DTYPES)} and HEAD in "
            f"{list(MATCHED_HEADS)}"
        )
    return (precision, *MATCHED_HEADS[head])


def matched_overrides(precision: str, policy_head: bool, engine_head: bool, model_impl: str) -> list[str]:
    """The ``ais-train`` overrides of one ``--matched`` row: the policy and the engine at ``precision`` (a key of
    :data:`MATCHED_DTYPES`), each LM head in fp32 or not, the engine's forward ``model_impl``."""
    from ais_lightning.toolkit.probes import override

    return [
        f"policy.dtype={MATCHED_DTYPES[precision]}",
        override("policy.head_dtype", "float32" if policy_head else None),
        f"rollout.precision={precision}",
        override("rollout.head_dtype", "float32" if engine_head else None),
        f"rollout.model_impl={model_impl}",
    ]


def measure_matched(policy, task, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row of ``args.matched``: trainer and engine at one precision (see the module docstring)."""
    import logging

    from ais_lightning.toolkit.probes import compose, policy_like

    rows = []
    build_log = logging.getLogger("ais_lightning.app.build")
    for spec in args.matched.split(","):
        precision, policy_head, engine_head = parse_matched(spec)
        overrides = [
            *args.overrides,
            *matched_overrides(precision, policy_head, engine_head, args.model_impl),
        ]
        level = build_log.level
        build_log.setLevel(logging.ERROR)  # the one-sided heads' warning: measured here to show why it warns
        try:
            _, c = compose(overrides)
        finally:
            build_log.setLevel(level)
        row_policy = policy_like(c.policy, policy).eval()
        row = measure_engine(row_policy, task, args, spec, lambda f=c.engine, p=row_policy: f(p.model))
        row.update(policy_head_fp32=policy_head, engine_head_fp32=engine_head)
        rows.append(row)
    return rows


def matched_markdown(rows: list[dict[str, Any]]) -> str:
    """Markdown of :func:`measure_matched`'s rows."""
    head = {(False, False): "model dtype", (True, True): "fp32, both sides"}
    lines = [
        "| trainer and engine | LM head | KL k3 (mean over seeds) | per-seed range | s.e. | token_mult_prob_error | "
        "max abs dlogp | greedy accuracy |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        sides = (r["policy_head_fp32"], r["engine_head_fp32"])
        where = head.get(sides, "fp32, engine only" if sides[1] else "fp32, policy only")
        lines.append(
            f"| `{r['precision'].partition(':')[0]}` | {where} | {r['kl_k3']:.2e} | {r['kl_k3_min']:.1e} .. "
            f"{r['kl_k3_max']:.1e} | {r['kl_k3_se']:.1e} | {r['token_mult_prob_error']:.5f} | "
            f"{r['max_abs_dlogp']:.3g} | {r['greedy_accuracy']:.3f} |"
        )
    return "\n".join(lines)


def check(policy, c, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The alignment check: the run's trainer-precision engine (fp32) and its rollout engine, in that order, each
    built as training builds it (``ais_lightning.toolkit.probes.training_engine``); an engine without a trainer-precision
    copy is checked against the torch engine at fp32 (``rollout=fp32``)."""
    from ais_lightning.toolkit.probes import fp32_engine, training_engine

    fp32 = fp32_engine(c, args.overrides)
    rollout_name = (getattr(c.engine, "keywords", None) or {}).get("precision", "rollout")
    fp32_label = "fp32" if c.eval_engine is not None else "fp32 (torch)"
    return [
        measure_engine(policy, c.task, args, fp32_label, lambda: training_engine(policy, fp32)),
        measure_engine(policy, c.task, args, f"{rollout_name}", lambda: training_engine(policy, c.engine)),
    ]


def alignment_table(rows: list[dict[str, Any]], gate: float | None) -> str:
    """Markdown: each engine's token_mult_prob_error and mismatch KL beside the peers' thresholds, our gate."""
    gate_text = f"<= {gate:g}" if gate is not None else "off"
    lines = [
        "| engine | token_mult_prob_error | NeMo-RL (<= 1.05) | ours: algorithm.max_fp32_mult_prob_error | "
        "mismatch KL k3 | prime-rl (< 0.015) | max abs dlogp |",
        "| --- | ---: | --- | --- | ---: | --- | ---: |",
    ]
    for i, r in enumerate(rows):
        mult, kl = r["token_mult_prob_error"], r["kl_k3"]
        ours = gate_text if i == 0 else "(fp32 only)"
        if i == 0 and gate is not None:
            ours += " pass" if mult <= gate else " FAIL"
        lines.append(
            f"| `{r['precision']}` | {mult:.5f} | {verdict('token_mult_prob_error', mult)} | {ours} | "
            f"{kl:.2e} | {verdict('kl_k3', kl)} | {r['max_abs_dlogp']:.3g} |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| precision | outlier channels | KL k3 (mean over seeds) | per-seed range | s.e. | token_mult_prob_error | "
        "max abs dlogp | greedy accuracy | sampled reward | build s | sync s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| `{r['precision']}` | {r['outlier_fraction']:g} | {r['kl_k3']:.2e} | {r['kl_k3_min']:.1e} .. "
            f"{r['kl_k3_max']:.1e} | {r['kl_k3_se']:.1e} | {r['token_mult_prob_error']:.4f} | "
            f"{r['max_abs_dlogp']:.2f} | {r['greedy_accuracy']:.3f} | "
            f"{r['sampled_reward']:.3f} | {r['build_s']:.1f} | {r['sync_s']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ais_lightning.toolkit.probes import add_overrides_argument

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precisions", default=PRECISIONS, help="comma-separated; precision[@outlier_fraction]")
    p.add_argument(
        "--check",
        action="store_true",
        help="alignment check: the run's fp32 engine and its rollout engine beside the peers' thresholds "
        "(exit 1 when fp32 misses one); ignores --precisions",
    )
    p.add_argument(
        "--matched",
        nargs="?",
        const=MATCHED,
        default=None,
        help="trainer and engine at the same precision: comma-separated PRECISION[:HEAD] rows (default rows: "
        f"{MATCHED}); ignores --precisions",
    )
    p.add_argument(
        "--model-impl",
        default="auto",
        choices=["auto", "lean", "transformers"],
        help="--matched: the torch engine's forward (rollout.model_impl)",
    )
    p.add_argument(
        "--warm-start",
        action="store_true",
        help="score the policy a run starts from (the built-in model's cached warm start), not its initial weights",
    )
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
    add_overrides_argument(p)
    args = p.parse_intermixed_args(argv)
    if args.matched is not None and "=" in args.matched:  # --matched without rows, then an override
        args.overrides.insert(0, args.matched)
        args.matched = MATCHED
    return args


def main(argv: list[str] | None = None) -> int:
    from ais_lightning.toolkit.probes import compose, write_json

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, c = compose(args.overrides)
    if args.eval_max_new_tokens is None:
        args.eval_max_new_tokens = c.algorithm.max_new_tokens
    if args.warm_start:
        policy, _ = c.initial_policy(cfg.seed, progress_bar=True)
        policy.eval()
    else:
        policy = c.policy.build(cfg.seed).eval()
    print(
        f"policy {cfg.policy._target_} ({sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M), task "
        f"{type(c.task).__name__} format {getattr(c.task, 'format', '-')}, torch threads {torch.get_num_threads()}"
    )
    if args.check:
        rows = check(policy, c, args)
    elif args.matched:
        rows = measure_matched(policy, c.task, args)
    else:
        rows = measure(policy, c.task, args)
    print()
    print(matched_markdown(rows) if args.matched and not args.check else markdown(rows))
    status = 0
    if args.check:
        gate = c.algorithm.max_fp32_mult_prob_error
        print()
        print(alignment_table(rows, gate))
        fp32 = rows[0]
        status = 0 if all(passes(m, fp32[m]) for m in THRESHOLDS) else 1
        verdict = (
            "pass" if status == 0 else "FAIL (the model code, the weight sync or the log-prob processing)"
        )
        print(
            f"\nfp32 alignment: {verdict}. The rollout row ({rows[1]['precision']}) is the low-precision "
            "mismatch the corrector handles; the peers' thresholds are for a model at its training precision."
        )
    write_json(args.json, {"args": vars(args), "rows": rows})
    return status


if __name__ == "__main__":
    sys.exit(main())
