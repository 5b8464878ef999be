"""GRPO's loop settings: sampling, advantages, the update schedule, the optimizer and validation."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ais_lightning.checks import check_int
from ais_lightning.losses import ADVANTAGE_SCALES
from ais_lightning.rollout.base import SamplingConfig
from ais_lightning.staleness import STALE_POLICIES, check_lag

__all__ = ["GRPOSettings"]


@dataclass
class GRPOSettings:
    """GRPO's loop: sampling, advantages, the update schedule, the optimizer and validation.

    The ``algorithm`` group of ``ais-train``; each default lives here only. The policy loss (clip range,
    KL, entropy bonus, aggregation, decoupled/bypass) is its own component (``ais_lightning.losses``).
    """

    prompts_per_step: int = 16
    """Prompts per rollout step (per rank)."""
    group_size: int = 8
    """Responses per prompt (the GRPO group); >= 2, since advantages are relative to the group."""
    max_new_tokens: int | None = None
    """Response length bound; None: the task's :meth:`~ais_lightning.tasks.Task.response_budget` (its longest
    reference solution in characters, rounded up to a power of two: 8 for bare arithmetic, 64 in chat format)."""
    temperature: float = 1.0
    """Sampling temperature (> 0; the trainer's log-probs use the same)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1.0 = off. Like ``top_k`` and ``min_p`` it renormalizes mu over the tokens
    it keeps; with ``replay_support`` the policy renormalizes pi over the same tokens (``RolloutBatch.support``)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    min_p: float = 0.0
    """Min-p sampling in [0, 1] (vLLM's ``min_p``: keep the tokens at least ``min_p`` times as likely as the most
    likely one; 0 = off)."""
    replay_support: bool = True
    """With truncation on (``top_p`` < 1, ``top_k`` > 0 or ``min_p`` > 0), the engine records the tokens it kept at
    every sampled position and the policy renormalizes pi over exactly those (pi_old, the loss's pi, the reference,
    entropies): pi / mu is then exact (:mod:`ais_lightning.rollout.support`). False: pi over the whole vocabulary,
    whose ratio to mu carries the kept mass; refused with a corrector."""
    advantage_scale: str = "group"
    """group | batch | none (Dr. GRPO): what the group-centred rewards are divided by."""
    seq_logprob_error_threshold: float | None = None
    """Drop a response whose mean exp(|log pi_old - log mu|) over its tokens exceeds this (NeMo-RL's option of
    the same name, e.g. 1.5 or 2): before the advantages, so it leaves the loss and its group's baseline and
    std (``losses.group_advantages(valid=...)``) and the corrector's batch. >= 1; None = off. The mismatch
    metrics still see every response; ``train/dropped_by_logprob_error`` counts the dropped (this rank)."""
    max_fp32_mult_prob_error: float | None = None
    """Stop the run at its first rollout step when the trainer-precision (fp32) engine's
    ``token_mult_prob_error`` against the policy exceeds this, measured on that step's prompts at the
    training temperature (NeMo-RL's acceptance of a new model: <= 1.05). Needs the trainer-precision engine
    (validation on and a rollout engine with an fp32 copy); >= 1; None = off."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per pass (the rollout batch is split into this many mini-batches)."""
    micro_batch_size: int | None = None
    """Rows (responses) per forward and backward: each mini-batch's gradient is accumulated over micro-batches
    of this many rows, each dividing its loss by the whole mini-batch's count (the loss's ``denominator``), so
    the update is the mini-batch's, up to float rounding, at a fraction of the activation memory (TRL's
    ``gradient_accumulation_steps``, verl's ``ppo_micro_batch_size``). None: the whole mini-batch at once."""
    lr: float = 3e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay (>= 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2), each in [0, 1); AIS v2 reads beta1 (``corrector.momentum``) from here."""
    grad_clip: float = 1.0
    """Max gradient norm (0 = off)."""
    val_every_n_steps: int = 50
    """Validation period in rollout steps."""
    val_size: int = 256
    """Held-out prompts for greedy validation accuracy."""
    val_batch_size: int | None = None
    """Prompts per validation batch (one greedy generation per engine each); None = ``prompts_per_step``.
    Validation decodes one row per prompt, a rollout ``prompts_per_step * group_size`` rows: up to that many
    prompts per batch fit in the rollout's memory and run a real model's decode GEMMs several times faster."""
    max_bad_steps: int = 5
    """Abort after this many consecutive rollout steps with non-finite log-probs, losses or gradients."""
    constant_reward_steps: int = 10
    """Log a WARNING (once) when every sample of this many consecutive rollout steps got the same reward (0:
    the reward never fired): GRPO's advantages are then zero and nothing is learned, e.g. because the policy
    does not answer in the task's format. 0 = no warning (the summary still reports a constant reward)."""
    truncate_prompts: bool = False
    """A prompt whose tokens plus ``max_new_tokens`` pass the policy model's context (``max_position_embeddings``)
    is cut to its last tokens that fit (one WARNING says how many were cut). False: such a prompt is refused,
    naming its length, ``max_new_tokens`` and the context (past it a model extrapolates its positions)."""
    max_staleness: int = 0
    """Asynchronous GRPO (docs/async.md): how many policy versions old a trained rollout may be, a version being the
    weights after one more rollout step's update; 0 = the synchronous loop (generate with the current weights,
    update, sync), bit for bit. The loss's trust region is then taken against the trainer's own log-probs at the
    current weights (decoupled PPO) and the corrector corrects pi_prox / mu, which carries both the precision and the
    staleness of the rollout."""
    on_stale: str = "wait"
    """What happens to rollouts staler than the bound: ``wait`` (the trainer takes rollouts of the oldest version the
    bound admits: generation waits for the trainer) | ``drop`` (they are discarded, counted in
    ``staleness/dropped``, and generated again with the current weights)."""
    rollout_lag: list[int] | None = None
    """The deterministic in-process mode: how many versions behind the trained weights each step's rollouts are
    generated, cycled over the steps (generation uses the kept weights of exactly that version); None =
    ``[max_staleness]``, the steady state of a pipeline of that depth. A lag above the bound goes by ``on_stale``.
    Rollout workers (``workers=ray``) ignore it: their staleness is what the timing makes it."""
    rollout_lag_random: bool = False
    """Draw each step's lag uniformly from ``rollout_lag`` (seeded by the run's seed and the step) instead of
    cycling through it: staleness that varies from step to step."""
    adaptive_staleness: bool = False
    """An adaptive bound (``ais_lightning.staleness.AdaptiveStalenessBound``): each step's bound is the largest
    staleness (<= ``max_staleness``) whose predicted chi^2 of the staleness part, from the measured drift per version,
    stays within ``staleness_chi2_target``: the trainer waits for fresher rollouts when the policy moves fast. False:
    the fixed bound ``max_staleness``. Needs ``measure_staleness``."""
    staleness_chi2_target: float | None = None
    """The adaptive bound's target; None: the loss's trust region squared (epsilon^2 of PPO's clip, 0.04 for GRPO's
    default: stale rows stay, on average, as close to pi_prox as one update may move it; docs/async.md)."""
    measure_staleness: bool = True
    """With ``max_staleness > 0``: split the mismatch into its precision part log(pi_v / mu) and its staleness part
    log(pi_prox / pi_v) (``mismatch/precision/*``, ``mismatch/staleness/*``) by scoring the stale rows with the
    trainer's weights of their generating version: one no-grad forward over the stale rows per step and an unsharded
    copy of the policy. AIS reads the staleness part."""

    MODULE: ClassVar[str] = "ais_lightning.modules.grpo.GRPOModule"
    """The LightningModule this algorithm runs, as an import path (``module_class`` resolves it)."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "ppo_epochs", "mini_batches", "val_every_n_steps"):
            check_int(getattr(self, name), name)
        if self.max_new_tokens is not None:
            check_int(self.max_new_tokens, "max_new_tokens")
        check_int(self.val_size, "val_size")
        if self.val_batch_size is not None:
            check_int(self.val_batch_size, "val_batch_size")
        check_int(self.max_bad_steps, "max_bad_steps")
        check_int(self.constant_reward_steps, "constant_reward_steps", minimum=0)
        if not isinstance(self.truncate_prompts, bool):
            raise ValueError(f"truncate_prompts must be true or false, got {self.truncate_prompts!r}")
        check_int(self.group_size, "group_size", minimum=2)
        check_int(self.top_k, "top_k", minimum=0)
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"temperature must be a finite number > 0 for RL (log-probs at T=0 are undefined), "
                f"got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if (
            isinstance(self.min_p, bool)
            or not isinstance(self.min_p, (int, float))
            or not 0.0 <= self.min_p <= 1.0
        ):
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not isinstance(self.replay_support, bool):
            raise ValueError(f"replay_support must be true or false, got {self.replay_support!r}")
        if self.advantage_scale not in ADVANTAGE_SCALES:
            raise ValueError(
                f"advantage_scale must be one of {list(ADVANTAGE_SCALES)}, got {self.advantage_scale!r}"
            )
        for name in ("seq_logprob_error_threshold", "max_fp32_mult_prob_error"):
            value = getattr(self, name)
            if value is not None and not (
                not isinstance(value, bool) and isinstance(value, (int, float)) and 1.0 <= value < math.inf
            ):
                raise ValueError(
                    f"{name} must be a finite number >= 1 (exp|log pi - log mu| >= 1) or None, got {value!r}"
                )
        if not (math.isfinite(self.lr) and 0 < self.lr <= 1):  # AdamW moves each weight by ~lr per step
            raise ValueError(
                f"lr must be a number in (0, 1] (AdamW moves every weight by about lr per step), got {self.lr}"
            )
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if (
            len(self.betas) != 2
            or any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in self.betas)
            or not all(0.0 <= b < 1.0 for b in self.betas)
        ):
            raise ValueError(
                f"betas must be two numbers in [0, 1) (AdamW's beta1, beta2), got {self.betas!r}"
            )
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(f"grad_clip must be a finite number >= 0 (0 = off), got {self.grad_clip}")
        rows = self.prompts_per_step * self.group_size
        if rows % self.mini_batches:
            raise ValueError(
                f"mini_batches={self.mini_batches} must divide prompts_per_step * group_size = {rows}"
            )
        if self.micro_batch_size is not None:
            check_int(self.micro_batch_size, "micro_batch_size")
        self._check_staleness()

    def _check_staleness(self) -> None:
        check_int(self.max_staleness, "max_staleness", minimum=0)
        if self.on_stale not in STALE_POLICIES:
            raise ValueError(f"on_stale must be one of {list(STALE_POLICIES)}, got {self.on_stale!r}")
        check_lag(self.rollout_lag)
        if self.rollout_lag is not None:
            self.rollout_lag = [int(k) for k in self.rollout_lag]
        for name in ("rollout_lag_random", "measure_staleness", "adaptive_staleness"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.max_staleness == 0 and any(self.rollout_lag or []):
            raise ValueError(
                f"rollout_lag={self.rollout_lag} generates with older weights, which needs max_staleness > 0 "
                "(the bound on how old a trained rollout may be)"
            )
        target = self.staleness_chi2_target
        if target is not None and (
            isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < math.inf
        ):
            raise ValueError(f"staleness_chi2_target must be a finite number > 0 or None, got {target!r}")
        if not isinstance(self.adaptive_staleness, bool):
            raise ValueError(f"adaptive_staleness must be true or false, got {self.adaptive_staleness!r}")
        if self.adaptive_staleness and (self.max_staleness == 0 or not self.measure_staleness):
            raise ValueError(
                "adaptive_staleness needs max_staleness > 0 (its largest bound) and measure_staleness=true (the "
                "bound follows the measured staleness mismatch)"
            )

    @property
    def lag(self) -> list[int]:
        """The deterministic mode's lag schedule: ``rollout_lag``, else ``[max_staleness]``."""
        return list(self.rollout_lag) if self.rollout_lag is not None else [self.max_staleness]

    @property
    def truncated(self) -> bool:
        """Whether sampling truncates (``top_p`` < 1, ``top_k`` > 0 or ``min_p`` > 0), renormalizing mu."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0

    def sampling(self, stop_token_id: int) -> SamplingConfig:
        """The rollouts' sampling: a group of ``group_size`` per prompt, stopping at ``stop_token_id`` (EOS)."""
        return SamplingConfig(
            n=self.group_size,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            record_support=self.replay_support,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=[stop_token_id],
        )

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """Optimizer steps one rollout step takes (Lightning's ``global_step`` counts these)."""
        return self.ppo_epochs * self.mini_batches

    @classmethod
    def module_class(cls) -> type:
        """The LightningModule this algorithm runs (``ais-train`` builds it with GRPOModule's arguments): the class
        :attr:`MODULE` names, ``GRPOModule`` here; an algorithm with a loop of its own (Sol-RL) names its subclass.
        A path, not an import: the module imports these settings."""
        module, _, name = cls.MODULE.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def check_components(self, components: Any, cfg: Any = None) -> None:
        """This algorithm's rules involving other config groups (``components``: ``ais_lightning.app.build.Components``;
        ``cfg``: the composed config), run once by ``ais-train`` among the rules between groups
        (``ais_lightning.app.rules``): ValueError naming the key. GRPO has none."""
