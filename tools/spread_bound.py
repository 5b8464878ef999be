"""Measure how far the entropy bound of AIS v2's spread G is from the exact spread.

AIS v2 measures the divergence severity against the policy's spread: β = 2D/G with G the collision
impurity 1 − Σ_a π(a)² of the trainer's next-token distribution (docs/ais.md section 3). Given only the
token entropy H (``AIS(spread="entropy_bound")``, AIS v2 as first released, or a caller without the
impurity), it uses 1 − e^{−H}, an upper bound (Rényi's order-2 entropy is at most Shannon's), which for
peaked tokens over-states G and under-states β. This tool draws
``--batches`` rollout batches through ``ais-train``'s own pipeline at fixed weights (the run's warm
start, its rollout engine and sampling; ``ais_lightning.toolkit.probes.run_probe``) and, for every valid
response token, computes both spreads from the trainer's full next-token distribution. It prints,
pooled over the batches: the two spreads and their ratio, β both ways, and AIS v2's λ both ways (the
corrector's own sufficient statistics from the pipeline's entropy or impurity; the trainer's β1 and
schedule).
It checks that its entropy and impurity equal the pipeline's (the same distribution is scored).

    python tools/spread_bound.py experiment=paper_small rollout=fp4 --batches 4
"""

from __future__ import annotations

import sys
from typing import Any

import torch

DEFAULT_OVERRIDES = ["experiment=paper_small", "rollout=fp4"]


def token_spreads(logits: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy bound, collision impurity)`` per position: ``1 − e^{−H}`` and ``1 − Σ_a π(a)²``.

    ``logits``: ``[..., V]`` next-token logits; π = softmax(logits / temperature). Both ``[...]`` float64.
    The first is never below the second (−log Σπ² ≤ H); they are equal for a uniform distribution.
    """
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)  # [..., V]
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    return -torch.expm1(-entropy), 1.0 - (p * p).sum(-1)


def _probe_class() -> type:
    from ais_lightning import ops
    from ais_lightning.correctors.ais import (
        ais_base_weights,
        ais_coefficient,
        ais_params,
        ais_sufficient_statistics,
    )
    from ais_lightning.modules.grpo import GRPOModule
    from ais_lightning.policy.policy import build_sequences
    from ais_lightning.toolkit.probes import probe_experience

    class SpreadProbe(GRPOModule):
        """GRPOModule whose training step scores the spread of every valid token and leaves the weights."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            s = self.settings
            self.params = ais_params(
                momentum=s.betas[0], ppo_epochs=s.ppo_epochs, mini_batches=s.mini_batches
            )
            self.sums = {"tokens": 0.0, "bound": 0.0, "collision": 0.0}
            self.lambdas: dict[str, list[float]] = {"bound": [], "collision": []}
            self.entropy_error = 0.0  # max |this tool's entropy - the pipeline's| over valid tokens
            self.impurity_error = 0.0  # the same for the impurity (float64 here, the pipeline's fp32)
            self.kl: list[float] = []  # the batches' mismatch KL (k3)

        def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
            exp, kl = probe_experience(self, batch)
            self.kl.append(kl)
            rollout, mask = exp.rollout, exp.rollout.response_mask  # mask: [B, T]
            temperature = self.sampling.temperature
            ids, attention, positions = build_sequences(
                rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, mask
            )
            prompt_len, length = rollout.prompt_ids.shape[1], rollout.response_ids.shape[1]
            with torch.no_grad():
                logits = self.policy.model(
                    input_ids=ids, attention_mask=attention, position_ids=positions
                ).logits
                logits = logits[
                    :, prompt_len - 1 : prompt_len + length - 1
                ]  # [B, T, V]: predicts each response token
                bound, collision = token_spreads(logits, temperature)  # [B, T] each
                scored = self.policy.batch_logprobs(rollout, temperature, compute_entropy=True)
            pipeline = scored.entropy  # [B, T]
            entropy = ops.entropy_from_logits(logits, temperature)  # [B, T], the pipeline's formula
            self.entropy_error = max(
                self.entropy_error, float((entropy - pipeline.double())[mask].abs().max())
            )
            self.impurity_error = max(
                self.impurity_error, float((collision - scored.impurity.double())[mask].abs().max())
            )
            self.sums["tokens"] += float(mask.sum())
            self.sums["bound"] += float(bound[mask].sum())
            self.sums["collision"] += float(collision[mask].sum())
            delta = ops.log_ratio(
                exp.train_logprobs, rollout.rollout_logprobs, mask
            )  # [B, T], as the corrector's
            base, _ = ais_base_weights(delta, mask, self.params)
            spreads = {"bound": None, "collision": scored.impurity}  # the two spreads AIS takes
            for name, impurity in spreads.items():
                stats = ais_sufficient_statistics(delta, mask, base, exp.advantages, pipeline, impurity)
                self.lambdas[name].append(float(ais_coefficient(stats, self.params)["lambda"]))
            self._empty_step(self.optimizers())  # counts the step, changes no weight

    return SpreadProbe


def measure(overrides: list[str], batches: int, seed: int = 0) -> dict[str, Any]:
    """The two spreads, β and λ both ways, pooled over ``batches`` rollout batches at fixed weights."""
    from ais_lightning.toolkit.probes import run_probe

    run = run_probe(overrides, batches, seed, _probe_class(), "spread_bound")
    probe = run.probe
    n = probe.sums["tokens"]
    kl = sum(probe.kl) / len(probe.kl)
    g_bound, g_collision = probe.sums["bound"] / n, probe.sums["collision"] / n
    return {
        "overrides": list(overrides),
        "seed": seed,
        "batches": batches,
        "tokens": int(n),
        "spread_entropy_bound": g_bound,
        "spread_collision": g_collision,
        "bound_over_collision": g_bound / g_collision if g_collision > 0 else float("inf"),
        "lambda_entropy_bound": sum(probe.lambdas["bound"]) / batches,
        "lambda_collision": sum(probe.lambdas["collision"]) / batches,
        "mismatch_kl_k3": kl,
        "entropy_max_abs_error": probe.entropy_error,
        "impurity_max_abs_error": probe.impurity_error,
        "seconds": run.seconds,
    }


def format_result(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"spread_bound {' '.join(r['overrides'])} (seed {r['seed']}, {r['batches']} batches, {r['tokens']} tokens)",
            f"  G from the entropy, mean 1 - exp(-H):   {r['spread_entropy_bound']:.4f}",
            f"  G exact, mean 1 - sum pi^2:             {r['spread_collision']:.4f}",
            f"  bound / exact (= beta exact / beta):    {r['bound_over_collision']:.2f}",
            f"  mismatch KL (k3), mean over batches:    {r['mismatch_kl_k3']:.4g}",
            f"  AIS v2 lambda, mean over batches:       {r['lambda_entropy_bound']:.4f} with the bound "
            f"(spread=entropy_bound), {r['lambda_collision']:.4f} with the exact spread (the default)",
            f"  check: |entropy - pipeline's| <= {r['entropy_max_abs_error']:.1e}, "
            f"|impurity - pipeline's| <= {r['impurity_max_abs_error']:.1e}; {r['seconds']:.0f} s",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    from ais_lightning.toolkit.probes import probe_main

    description = __doc__.split("\n\n")[0]
    return probe_main(argv, description, DEFAULT_OVERRIDES, 4, measure, format_result)


if __name__ == "__main__":
    sys.exit(main())
