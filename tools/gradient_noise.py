"""Measure the GRPO gradient's noise-to-signal ratio φ, the one constant of AIS v2 the corrector cannot see.

AIS v2 mixes the uncorrected and the importance-weighted gradient with λ = Rβ² / (Rβ² + aφχ²_A), where
``φ = Var(Ĝ)/|g|²`` is the noise-to-signal ratio of the batch gradient (``corrector.noise_to_signal``,
default 1: the batch at its critical size; docs/ais.md section 6) and ``a = (1 − β1)/(1 + β1)`` the
averaging of AdamW's first moment (``algorithm.betas[0]``, which ``corrector.momentum`` reads; with
several optimizer steps per rollout batch, ``averaged_noise_factor(β1, ppo_epochs, mini_batches)``).
This tool measures φ for a configuration: the real ``ais-train`` pipeline
(``ais_lightning.app.build.validate`` of the composed config, its warm start, ``GRPOModule`` under a
one-process Lightning Trainer) draws ``--batches`` rollout
batches at the *same* weights (no optimizer step), and for every prompt group computes the gradient of
its part of the GRPO loss at the first optimizer step of an update (π_θ = π_old, the corrector's
weights applied, ``corrector=none`` by default). The groups are the independent units (GRPO normalises
advantages within a group); a group's gradient is scaled by ``groups_per_batch · n_group / n_batch`` so
that a batch's token-mean gradient is the plain mean of its groups'. From all groups
(``ais_lightning.diagnostics.gradient_noise.gradient_noise_scale``, McCandlish et al. 2018):

    B_noise = tr(Σ) / |G|²  (in groups),   φ = B_noise / prompts_per_step

Prints the table, the same φ averaged over steps by the trainer's AdamW (``aφ``: what AIS v2 weighs
the variance with; 1/19 for φ = 1 at β1 = 0.9) and the override that sets the measured φ
(``corrector.noise_to_signal=<φ>``); ``--json`` writes it.
Every ``ais-train`` override is accepted; the default is the paper protocol's FP4 run:

    python tools/gradient_noise.py experiment=paper_small rollout=fp4 --batches 8
    python tools/gradient_noise.py experiment=paper_sudoku4 rollout=fp4 --json phi.json
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from ais_lightning.diagnostics.gradient_noise import averaged_noise_factor

DEFAULT_OVERRIDES = ["experiment=paper_small", "rollout=fp4"]


def _probe_class() -> type:
    from ais_lightning.modules.grpo import GRPOModule
    from ais_lightning.toolkit.probes import probe_experience

    class GradientProbe(GRPOModule):
        """GRPOModule whose training step records per-group gradients and leaves the weights as they are."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.unit_grads: list[torch.Tensor] = []  # one [P] per group
            self.kl: list[float] = []
            # max over batches of |mean of the units - batch gradient| / |batch gradient|
            self.unit_mean_error = 0.0

        def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
            exp, kl = probe_experience(self, batch)
            self.kl.append(kl)
            params = [p for p in self.policy.parameters() if p.requires_grad]

            def flat_grad(part: Any) -> torch.Tensor:  # [P]
                grads = torch.autograd.grad(self._loss(part).loss, params, allow_unused=True)
                return torch.cat(
                    [(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)]
                ).double()

            groups = exp.rollout.prompt_index.unique()  # [U] prompts of this batch
            n_batch = exp.loss_mask.sum().clamp(min=1)
            units = []
            for prompt in groups:
                rows = (exp.rollout.prompt_index == prompt).nonzero().flatten()  # [G] rows of one group
                part = exp.rows(rows)
                units.append(len(groups) * part.loss_mask.sum() / n_batch * flat_grad(part))
            # the units' mean must be the batch's own gradient (the scaling above): checked, not assumed
            whole = flat_grad(exp.rows(torch.arange(exp.rewards.shape[0])))
            error = (torch.stack(units).mean(0) - whole).norm() / whole.norm().clamp(min=1e-30)
            self.unit_mean_error = max(self.unit_mean_error, float(error))
            self.unit_grads.extend(units)
            self._empty_step(self.optimizers())  # counts the step, changes no weight

    return GradientProbe


def measure(overrides: list[str], batches: int, seed: int = 0) -> dict[str, Any]:
    """φ and the quantities behind it for the composed config (``--batches`` rollout batches, fixed weights)."""
    from ais_lightning.diagnostics.gradient_noise import gradient_noise_scale
    from ais_lightning.toolkit.probes import run_probe

    run = run_probe(overrides, batches, seed, _probe_class(), "gradient_noise")
    c, probe, warm = run.components, run.probe, run.warm
    noise = gradient_noise_scale(torch.stack(probe.unit_grads))  # [U, P]
    groups_per_batch = c.algorithm.prompts_per_step
    phi = noise.noise_to_signal(groups_per_batch)
    return {
        "overrides": list(overrides),
        "seed": seed,
        "warm_start_accuracy": None if warm is None else warm.accuracy,
        "batches": batches,
        "groups": noise.units,
        "groups_per_batch": groups_per_batch,
        "group_size": c.algorithm.group_size,
        "mismatch_kl_k3": sum(probe.kl) / len(probe.kl),
        "trace_sigma": noise.trace,
        "signal_sq": noise.signal_sq,
        "noise_scale_groups": noise.noise_scale,
        "noise_to_signal": phi,
        "adam_beta1": c.algorithm.betas[0],
        "noise_to_signal_averaged": phi
        * averaged_noise_factor(c.algorithm.betas[0], c.algorithm.ppo_epochs, c.algorithm.mini_batches),
        "unit_mean_rel_error": probe.unit_mean_error,
        "seconds": run.seconds,
    }


def _advice(r: dict[str, Any]) -> str:
    if r["trace_sigma"] == 0 and r["signal_sq"] == 0:
        return "every group's gradient is zero (equal rewards within every group): no advantage, nothing to measure"
    if not math.isfinite(r["noise_to_signal"]):
        return "the signal is lost in the noise at this many groups (|G|² <= 0): measure more --batches"
    return f"AIS v2 with this batch: corrector.noise_to_signal={r['noise_to_signal']:.3g} (default 1)"


def format_result(r: dict[str, Any]) -> str:
    phi = r["noise_to_signal"]
    lines = [
        f"gradient noise of {' '.join(r['overrides'])} (seed {r['seed']})",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| groups measured ({r['batches']} batches x {r['groups_per_batch']} prompts x {r['group_size']} samples) "
        f"| {r['groups']} |",
        f"| mismatch KL k3 (token mean) | {r['mismatch_kl_k3']:.3e} |",
        f"| tr(Σ) per group | {r['trace_sigma']:.4e} |",
        f"| \\|G\\|² | {r['signal_sq']:.4e} |",
        f"| B_noise (groups) | {r['noise_scale_groups']:.2f} |",
        f"| φ = B_noise / {r['groups_per_batch']} | **{phi:.3f}** |",
        f"| φ averaged by AdamW's first moment (β1 = {r['adam_beta1']:g}) | {r['noise_to_signal_averaged']:.3f} |",
        f"| check: \\|mean of groups − batch gradient\\| / \\|batch gradient\\| | {r['unit_mean_rel_error']:.1e} |",
        "",
        _advice(r),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ais_lightning.toolkit.probes import probe_main

    description = __doc__.split("\n\n")[0]
    return probe_main(argv, description, DEFAULT_OVERRIDES, 8, measure, format_result)


if __name__ == "__main__":
    sys.exit(main())
