"""GRPOModule: GRPO on low-precision rollouts with an importance-sampling corrector.

The module only orchestrates; the math lives in reusable pieces:

    prompts --engine.generate--> RolloutBatch (mu log-probs, low precision)
            --task.reward-->      rewards --group_advantages--> A
            --policy-->           pi_old log-probs and entropy (with autograd when one optimizer step
                                  follows: that forward is then also the loss's, one forward saved)
            --ops.log_ratio-->    delta, once, for the corrector and every metric
            --corrector-->        IS weights, kept-token mask   (ais_lightning.correctors)
            --loss over mini-batches--> optimizer steps         (ais_lightning.losses)
            --policy.full_state_dict--> engine.sync_weights

Manual optimization: one ``training_step`` is one rollout step and takes ``ppo_epochs *
mini_batches`` optimizer steps, so Lightning's ``global_step`` counts optimizer steps. A step whose
numbers are not finite changes no weight but still counts (an empty optimizer step), so a run always
ends; ``max_bad_steps`` consecutive bad steps abort it with an error.

A float16 policy trains with fp32 master weights and a dynamic loss scale
(:mod:`ais_lightning.modules.mixed_precision`): the loss is scaled before backward, the gradients are unscaled into
the masters before clipping, and a mini-batch whose gradients overflow on some rank is skipped on every rank like
any non-finite step, backing off the scale (``train/loss_scale`` is logged).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from lightning import LightningModule
from torch import nn

from ais_lightning import ops
from ais_lightning.diagnostics import (
    ErrorTokenRate,
    MismatchDiagnostics,
    RoutingDisagreement,
    TokenEntropy,
    TokenMultProbError,
    sequence_mult_prob_error,
)
from ais_lightning.losses import PolicyLoss, group_advantages
from ais_lightning.models.routing import moe_routers, routing_replay_mask
from ais_lightning.modules.experience import Experience
from ais_lightning.modules.grpo_settings import GRPOSettings
from ais_lightning.modules.mixed_precision import build_optimizer, master_optimizer
from ais_lightning.policy import Policy
from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig
from ais_lightning.rollout.factory import EngineSpec
from ais_lightning.tasks import SOLVED_REWARD, Task, safe_rewards, task_fields

EngineFactory = Callable[[nn.Module], RolloutEngine]
"""Builds an engine from an unsharded copy of the policy's model."""

log = logging.getLogger(__name__)

# The public path, which configs name as the algorithm group's _target_ (ais_lightning.app.config.target_path).
GRPOSettings.__module__ = __name__


class GRPOModule(LightningModule):
    """GRPO with a rollout engine and a corrector; every component is passed in built.

    Args:
        policy: the trainer's policy (high precision), with its ``tokenizer``.
        task: the prompts' reward function (``ais_lightning.tasks.Task``).
        corrector: ``NoCorrection`` / ``TIS`` / ``MIS`` / ``AIS`` ... (an nn.Module; its state is checkpointed).
        loss: a policy loss, an ``ais_lightning.losses.PolicyLoss`` (``GRPOLoss``, QaRL's ``TBPOLoss``, ...); it
            gets pi_old, mu and the corrector's weights and uses what it needs.
        engine_factory: builds the rollout engine (an ``ais_lightning.rollout.RolloutEngine``) from an unsharded
            model (called once per rank): an ``ais_lightning.rollout.EngineSpec`` (what ``ais-train`` passes), a
            ``functools.partial`` of an engine class, or any callable. Its checks against the policy (a progressive
            ``aligned_schedule`` needs an engine that switches precision) run where the engine class shows; a
            spec's own checks are not run again.
        settings: GRPO's loop settings (``GRPOSettings``).
        eval_engine_factory: builds a trainer-precision engine for validation (None = skip that half).
        seed: base seed; rollout step s on rank r samples with a seed derived from (seed, s, r).
    """

    HISTORY_STATS: ClassVar[dict[str, str]] = {}
    """Fields a subclass adds to each :attr:`history` entry: entry name -> the step's stats key it copies."""

    def __init__(
        self,
        policy: Policy,
        task: Task,
        corrector: nn.Module,
        loss: PolicyLoss,
        engine_factory: EngineFactory,
        settings: GRPOSettings | None = None,
        eval_engine_factory: EngineFactory | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if policy.tokenizer is None:
            raise ValueError(
                "policy.tokenizer is None: the GRPO module encodes prompts with the policy's tokenizer"
            )
        from ais_lightning.policy.builders import check_aligned_schedule_engine

        check_aligned_schedule_engine(policy.aligned_schedule, engine_factory)
        self.automatic_optimization = False
        self.policy = policy
        self.task = task
        self.corrector = corrector
        self.loss_fn = loss
        self.engine_factory = engine_factory
        self.eval_engine_factory = eval_engine_factory
        settings = settings if settings is not None else GRPOSettings()
        if settings.max_new_tokens is None:  # the task's budget (ais-train settles it at validation already)
            settings = dataclasses.replace(settings, max_new_tokens=task.response_budget())
        self.settings = settings
        self.seed = seed
        s = self.settings
        self.sampling = SamplingConfig(
            n=s.group_size,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_new_tokens=s.max_new_tokens,
            stop_token_ids=[policy.tokenizer.eos_token_id],
        )
        self.reference = copy.deepcopy(policy).requires_grad_(False) if loss.needs_reference else None
        self.mismatch = MismatchDiagnostics(prefix="mismatch/")
        self.entropy_metric = TokenEntropy()
        # QaRL's failure mode of quantized rollouts: degenerate, repetitive or garbled "error tokens".
        self.error_metrics = nn.ModuleDict(
            {
                "repeat_frac": ErrorTokenRate("repeat", min_ngram=2),
                "low_logprob_frac": ErrorTokenRate("low_logprob"),
            }
        )
        n_moe = len(moe_routers(policy.model))
        self.routing_metrics = (
            nn.ModuleDict(
                {"disagreement": RoutingDisagreement()}
                | {f"disagreement_layer{i}": RoutingDisagreement(layer=i) for i in range(n_moe)}
            )
            if n_moe
            else None
        )
        """Mixture-of-experts policies: how often the trainer's own top-k experts differ from the engine's, overall
        and per MoE layer (``routing/...``, logged beside the mismatch KL); None for dense policies."""
        self.engine: RolloutEngine | None = None
        self._engine_calibration: Any = None  # a checkpoint's engine calibration, until the engine takes it
        self.eval_engine: RolloutEngine | None = None
        self.bad_steps = 0
        """Consecutive rollout steps whose numbers were not finite (reset by a good step)."""
        self.history: list[dict[str, float]] = []
        """Per-rollout-step summary (reward, mismatch, lambda...), kept in checkpoints."""
        self.validation_start: dict[str, float] = {}
        """Validation metrics before the first update (set by the caller), kept in checkpoints."""
        self.reward_alarm: dict[str, Any] = {"streak": 0, "value": None, "first_step": 0, "warned": False}
        """The constant-reward alarm (kept in checkpoints): consecutive rollout steps whose samples all got one
        reward, that reward, the first of those steps, and whether the warning was logged."""
        self.validation_history: list[dict[str, Any]] = []
        """Every validation (kept in checkpoints): ``{"step", "accuracy": {"val/accuracy_<engine>": float},
        "example": {"prompt", "completion", "solution"}}``, the example being the first validation prompt and
        the engine's greedy completion of it; the summary reads it."""
        self._val_tally: dict[str, list[float]] = {}
        self._val_example: dict[str, str] | None = None

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    # ------------------------------------------------------------------ setup
    def setup(self, stage: str) -> None:
        """QaRL's aligned forward, if the policy asks for it (after any warm start, before sharding)."""
        self.policy.apply_aligned_quantization()

    def configure_model(self) -> None:
        """FSDP2: shard every decoder layer, then the root (Lightning ModelParallelStrategy)."""
        mesh = getattr(self, "device_mesh", None)
        if mesh is None:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.policy, FSDPModule):  # the hook runs once per trainer.fit/validate call
            return

        dp_mesh = mesh["data_parallel"]
        for layer in self.policy.decoder_layers():
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.policy, mesh=dp_mesh)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over the policy's parameters; for a float16 policy, on fp32 master weights with a dynamic loss
        scale (:func:`ais_lightning.modules.mixed_precision.build_optimizer`; unsharded models only)."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        adamw = functools.partial(
            torch.optim.AdamW,
            lr=self.settings.lr,
            betas=self.settings.betas,
            weight_decay=self.settings.weight_decay,
        )
        sharded = self._fsdp1_root() is not None or any(type(p).__name__ == "DTensor" for p in params)
        if sharded and any(p.dtype == torch.float16 for p in params):
            raise ValueError(
                "policy.dtype=float16 (fp32 master weights and a loss scale) is not supported with sharded "
                "strategies yet (trainer.strategy): use trainer.strategy=auto, or policy.dtype=bfloat16"
            )
        return build_optimizer(params, adamw)

    def on_train_start(self) -> None:
        """Build the engines once the weights (possibly restored from a checkpoint) are in place.

        Engines built earlier in this process (by a validation before ``fit``) are given the current weights
        instead of being built again. When the trainer-precision engine would be built exactly as the
        rollout engine (an fp32 rollout), the rollout engine serves both: one copy of the model, not two.
        """
        state = self._full_state()
        if self.engine is None:
            self.engine = self._build_engine(self.engine_factory, state)
        else:
            self.engine.sync_weights(state)
        if self.eval_engine_factory is not None:
            if same_engine(self.eval_engine_factory, self.engine_factory):
                self.eval_engine = self.engine
            elif self.eval_engine is None:
                self.eval_engine = self._build_engine(self.eval_engine_factory, state)
            else:
                self.eval_engine.sync_weights(state)
        self.apply_precision_schedule()  # a resumed run lands in the stage of its step
        self._restore_engine_calibration()

    def _validation_generate(
        self, engine: RolloutEngine, prompts: list[str], greedy: SamplingConfig
    ) -> RolloutBatch:
        """``engine.generate`` for validation, leaving the engine's calibration (outlier channels, ranges seen
        since the last sync) as it was: validation never changes what training does, so a run trains the
        same whether and how often it validates, and a resumed run as the uninterrupted one."""
        state = engine.calibration_state()
        try:
            return engine.generate(self.encode_prompts(prompts), greedy)
        finally:
            if state is not None:
                engine.load_calibration_state(state)

    def _restore_engine_calibration(self) -> None:
        """A resumed run's engine takes the checkpoint's calibration (outlier channels and the ranges seen since
        the last sync), so it quantizes as the uninterrupted run would; once, after the engine is built."""
        state, self._engine_calibration = self._engine_calibration, None
        if state is None or self.engine is None:
            return
        try:
            self.engine.load_calibration_state(state)
        except ValueError as err:
            log.warning("the checkpoint's engine calibration does not fit the engine, recalibrating: %s", err)

    def apply_precision_schedule(self, step: int | None = None) -> dict[str, float]:
        """Progressive precision: move the aligned forward and the rollout engine to a step's stage together.

        With ``policy.aligned_schedule`` (Bit-by-Bit, e.g. int8 -> int4 -> int2) the stage is a function of
        the rollout step alone (``step``, default: the next one to train), so this is idempotent and a
        resumed run lands in the right stage. The trainer's quantized linears switch recipe (fp32 master
        weights and optimizer state untouched) and the engine switches its precision in place
        (``engine.set_precision``). Returns the ``quant/stage`` and ``quant/bits`` (weight bits) to log;
        empty without a schedule.
        """
        if self.policy.aligned_schedule is None:
            return {}
        from ais_lightning.quant import FORMATS, get_recipe

        step = self.rollout_step if step is None else step
        recipe = self.policy.set_aligned_step(step)
        if self.engine is not None and self.engine.precision != recipe:
            if not self.engine.SUPPORTS_SET_PRECISION:
                raise ValueError(
                    f"policy.aligned_schedule moves to {recipe!r} at rollout step {step}, but the rollout engine "
                    f"{type(self.engine).__name__} cannot switch its precision (no set_precision)"
                )
            self.engine.set_precision(recipe)
        return {
            "quant/stage": float(self.policy.aligned_stage_at(step)),
            "quant/bits": float(FORMATS[get_recipe(recipe).weight_fmt].bits),
        }

    def _build_engine(self, factory: EngineFactory, state: list[tuple[str, torch.Tensor]]) -> RolloutEngine:
        # Outside inference mode even when a validation builds it (Lightning validates under inference mode):
        # the engine outlives that validation, and later syncs write its weights in place.
        with torch.inference_mode(False):
            fresh = self.policy.fresh_model().to(self.device)  # unsharded model of the same config
            engine = factory(fresh)
            if not isinstance(engine, RolloutEngine):
                raise TypeError(
                    f"the engine factory built a {type(engine).__name__}, not a rollout engine (a subclass of "
                    "ais_lightning.rollout.RolloutEngine)"
                )
            engine.sync_weights(state)
        return engine

    # ---------------------------------------------------------------- rollout
    @property
    def rollout_step(self) -> int:
        """Rollout steps done so far (Lightning's global_step counts optimizer steps)."""
        return self.global_step // self.settings.optimizer_steps_per_rollout

    def _sampling_seed(self, stage: int = 0) -> int:
        return (self.seed * 1_000_003 + self.rollout_step * 10_007 + self.global_rank * 101 + stage) % (2**31)

    def encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        """The policy's token ids of ``prompts``, fitted to its model's context with ``max_new_tokens``
        (:func:`ais_lightning.rollout.prompts.fit_context`: refused naming the lengths, or cut with
        ``settings.truncate_prompts``)."""
        from ais_lightning.rollout.prompts import context_length, fit_context

        ids, cut = fit_context(
            self.policy.encode_prompts(prompts),
            self.settings.max_new_tokens,
            context_length(self.policy.model),
            self.settings.truncate_prompts,
        )
        if cut and not getattr(self, "_warned_truncation", False):
            self._warned_truncation = True
            log.warning(
                "algorithm.truncate_prompts: %d of %d prompts were longer than the model's context (%s) less "
                "max_new_tokens=%d and were cut to their last tokens (this warning is logged once)",
                cut,
                len(ids),
                context_length(self.policy.model),
                self.settings.max_new_tokens,
            )
        return ids

    def decode_responses(self, batch: RolloutBatch) -> list[str]:
        return [
            self.tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
            for ids, mask in zip(batch.response_ids, batch.response_mask)
        ]

    def score(
        self, batch: RolloutBatch, prompts: list[str], fields: dict[str, list]
    ) -> tuple[torch.Tensor, int]:
        """Rewards of every row (rows answer ``prompts[batch.prompt_index]``); failures score 0."""
        index = batch.prompt_index.tolist()
        completions = self.decode_responses(batch)
        row_prompts = [prompts[i] for i in index]
        row_fields = {k: [v[i] for i in index] for k, v in fields.items()}
        rewards, n_failed = safe_rewards(self.task.reward, row_prompts, completions, row_fields)
        return torch.as_tensor(rewards, dtype=torch.float32, device=self.device), int(n_failed)

    def generate_rollouts(
        self,
        prompts: list[str],
        sampling: SamplingConfig | None = None,
        engine: RolloutEngine | None = None,
        **generate_kwargs: Any,
    ) -> RolloutBatch:
        """The responses of ``engine`` (default: the rollout engine) to ``prompts``, on this module's device.

        ``sampling`` defaults to GRPO's: ``group_size`` responses per prompt at the training temperature, seeded
        by this rollout step and rank. ``generate_kwargs`` go to ``engine.generate`` (Sol-RL's ``uniforms``).
        The first half of :meth:`collect_experience`; :meth:`build_experience` is the second.
        """
        engine = self.engine if engine is None else engine
        assert engine is not None, "on_train_start builds the engine"
        if sampling is None:
            sampling = dataclasses.replace(self.sampling, seed=self._sampling_seed())
        return ops.to_device(
            engine.generate(self.encode_prompts(prompts), sampling, **generate_kwargs), self.device
        )

    def collect_experience(
        self, prompts: list[str], fields: dict[str, list], keep_graph: bool = False
    ) -> tuple[Experience | None, dict[str, float]]:
        """Generate (:meth:`generate_rollouts`), then score, compute advantages, pi_old and the corrector
        weights (:meth:`build_experience`); the stats also time the generation."""
        t0 = time.perf_counter()
        batch = self.generate_rollouts(prompts)
        rollout_time = time.perf_counter() - t0
        exp, stats = self.build_experience(batch, prompts, fields, keep_graph)
        stats["time/rollout_s"] = rollout_time
        stats["throughput/rollout_tokens_per_s"] = batch.num_tokens / max(rollout_time, 1e-9)
        return exp, stats

    def build_experience(
        self, batch: RolloutBatch, prompts: list[str], fields: dict[str, list], keep_graph: bool = False
    ) -> tuple[Experience | None, dict[str, float]]:
        """Score a generated ``batch`` (its rows answer ``prompts[batch.prompt_index]``, groups of ``group_size``
        contiguous rows), compute advantages, pi_old and the corrector weights, and update the step's metrics.

        ``keep_graph``: run pi_old's forward with autograd and keep it as ``Experience.current``, the
        forward of the loss. Exact only when a single optimizer step follows (the weights have not moved
        since pi_old, so the loss's forward would return the same numbers, bit for bit on CPU); it saves
        one policy forward per rollout step (``training_step`` sets it when ``ppo_epochs * mini_batches
        == 1``; TRL's GRPOTrainer takes pi_old from the loss's forward in that case likewise).

        Returns ``(None, stats)`` when any rank has non-finite log-probs on valid tokens: the step is
        skipped on every rank (the decision is all-reduced, so collectives stay matched).
        """
        if self.policy.router_replay and batch.routing is None:
            raise ValueError(
                f"policy.router_replay=true, but the rollout engine ({type(self.engine).__name__}) returned no routing "
                "(RolloutBatch.routing): use an engine that records it (TorchRolloutEngine) or router_replay=false"
            )

        rewards, n_failed = self.score(batch, prompts, fields)  # [B]
        mask = batch.response_mask  # [B, T]
        t1 = time.perf_counter()
        with torch.set_grad_enabled(keep_graph):
            pi_old = self.policy.batch_logprobs(
                batch, self.sampling.temperature, compute_entropy=True, entropy_grad=self._loss_needs_entropy
            )
        logprob_time = time.perf_counter() - t1
        # [B, T] each, values only: the corrector and the metrics never differentiate them
        train_lp, entropy, impurity = (t.detach() for t in (pi_old.logprobs, pi_old.entropy, pi_old.impurity))

        stats = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(unbiased=False).item(),
            "reward/failed": float(n_failed),
            "response/length_mean": mask.sum(-1).float().mean().item(),
            "response/stop_frac": sum(r == "stop" for r in batch.finish_reason)
            / max(len(batch.finish_reason), 1),
            "time/logprob_s": logprob_time,
        }
        valid_lp = torch.where(mask, train_lp + batch.rollout_logprobs, torch.zeros_like(train_lp))  # [B, T]
        finite = self._all_ranks_finite(valid_lp)
        stats["train/nonfinite_logprobs"] = float(not finite)
        if not finite:
            return None, stats

        # Responses too mismatched to train on (seq_logprob_error_threshold) leave before the advantages: out of
        # their group's baseline, the corrector's batch and the loss. The mismatch metrics still see them.
        keep = self._kept_responses(train_lp, batch.rollout_logprobs, mask, stats)  # [B] bool, or None
        s = self.settings
        advantages = group_advantages(rewards, s.group_size, scale=s.advantage_scale, valid=keep)  # [B]
        train_mask = mask if keep is None else mask & keep.unsqueeze(-1)  # [B, T]
        # delta = log pi_old - log mu, once: the corrector and every mismatch metric read it.
        delta = ops.log_ratio(train_lp, batch.rollout_logprobs, mask)  # [B, T]
        self.mismatch.update(
            train_lp,
            batch.rollout_logprobs,
            mask,
            advantages=advantages,
            entropy=entropy,
            log_ratio=delta,
            impurity=impurity,
        )
        self.entropy_metric.update(entropy, mask)
        self._update_routing_metrics(batch)
        self.error_metrics["repeat_frac"].update(batch.response_ids, mask)
        self.error_metrics["low_logprob_frac"].update(train_lp, mask)
        correction = self.corrector.from_log_ratio(
            delta if keep is None else torch.where(train_mask, delta, torch.zeros_like(delta)),
            train_mask,
            advantages=advantages,
            entropy=entropy,
            train_logprobs=train_lp,
            rollout_logprobs=batch.rollout_logprobs,
            impurity=impurity,
        )
        stats.update(correction.stats)
        kept = correction.mask & train_mask
        exp = Experience(
            batch, rewards, advantages, train_lp, correction.weights, kept, pi_old if keep_graph else None
        )
        return exp, stats

    def _check_fp32_alignment(self, prompts: list[str]) -> dict[str, float]:
        """The optional gate ``max_fp32_mult_prob_error``: sample ``prompts`` with the trainer-precision engine
        as a rollout would, score its log-probs against the policy's (``TokenMultProbError``, over every rank's
        tokens, so every rank takes the same decision) and raise RuntimeError above the limit. Returns
        ``{"alignment/fp32_token_mult_prob_error": value}`` to log; ``{}`` when the gate is off."""
        limit = self.settings.max_fp32_mult_prob_error
        if limit is None:
            return {}
        if self.eval_engine is None:
            raise ValueError(
                f"algorithm.max_fp32_mult_prob_error={limit} needs the trainer-precision (fp32) engine, which this "
                "run does not build (validation off, or a rollout engine without an fp32 copy); unset it and check "
                "the model with tools/model_mismatch.py --check instead"
            )
        sampling = dataclasses.replace(self.sampling, seed=self._sampling_seed(stage=2))
        batch = ops.to_device(self._validation_generate(self.eval_engine, prompts, sampling), self.device)
        with torch.no_grad():
            train_lp = self.policy.batch_logprobs(batch, self.sampling.temperature).logprobs  # [B, T]
        mask = batch.response_mask  # [B, T]
        if not self._all_ranks_finite(torch.where(mask, train_lp + batch.rollout_logprobs, 0.0)):
            raise RuntimeError(
                "algorithm.max_fp32_mult_prob_error: non-finite log-probs from the trainer-precision engine or the "
                "policy on the first rollout step's prompts; the fp32 alignment cannot be measured"
            )
        metric = TokenMultProbError().to(self.device)
        metric.update(train_lp, batch.rollout_logprobs, mask)
        value = float(metric.compute())
        if not value <= limit:
            raise RuntimeError(
                f"fp32 alignment check failed: token_mult_prob_error of the trainer-precision engine against the "
                f"policy is {value:.6g} > algorithm.max_fp32_mult_prob_error={limit} (NeMo-RL accepts a new model "
                "at <= 1.05). At fp32 both sides compute the same model, so the gap is in the model code, the weight "
                "sync or the log-prob processing (temperature, masking): compare with tools/model_mismatch.py "
                "--check, or raise or unset algorithm.max_fp32_mult_prob_error"
            )
        return {"alignment/fp32_token_mult_prob_error": value}

    def _kept_responses(
        self, train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, stats: dict[str, float]
    ) -> torch.Tensor | None:
        """The responses whose mean exp|log pi_old - log mu| is within ``seq_logprob_error_threshold``.  # [B]

        None when the option is off. Counts the dropped ones in ``stats`` (this rank).
        """
        threshold = self.settings.seq_logprob_error_threshold
        if threshold is None:
            return None
        keep = sequence_mult_prob_error(train_lp, rollout_lp, mask) <= threshold  # [B]
        stats["train/dropped_by_logprob_error"] = float((~keep).sum())
        return keep

    def _update_routing_metrics(self, batch: RolloutBatch) -> None:
        """Engine vs trainer routing of pi_old's forward (the trainer's own top-k, replayed or not)."""
        replay = self.policy.routing_replay
        last = replay.last_routing() if replay is not None else None
        if self.routing_metrics is None or batch.routing is None or last is None:
            return
        own, _ = last  # [B, P + T, L, k]
        valid = routing_replay_mask(batch.prompt_mask, batch.response_mask)  # [B, P + T]
        for metric in self.routing_metrics.values():
            metric.update(batch.routing, own, valid)

    # ----------------------------------------------------------------- update
    def _all_ranks_finite(self, value: torch.Tensor) -> bool:
        finite = bool(torch.isfinite(value).all())
        return bool(self.trainer.strategy.reduce_boolean_decision(finite, all=True))

    def _empty_step(self, opt: Any, overflow: bool = False) -> None:
        """An optimizer step that changes nothing (no parameter has a gradient) but counts toward
        ``max_steps``, so that a run with bad steps still ends. ``overflow``: the gradients were not finite on some
        rank, which backs off a float16 policy's loss scale (on every rank alike)."""
        fp16 = master_optimizer(opt)
        if overflow and fp16 is not None:
            fp16.record_overflow()
        opt.zero_grad(set_to_none=True)
        opt.step()

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times a float16 policy's loss scale (the loss itself otherwise): what backward runs on."""
        fp16 = master_optimizer(self.optimizers())
        return fp16.scale_loss(loss) if fp16 is not None else loss

    def update_policy(self, exp: Experience) -> dict[str, float]:
        """``ppo_epochs`` passes of ``mini_batches`` optimizer steps over one rollout batch."""
        opt = self.optimizers()
        s = self.settings
        n_rows = exp.rewards.shape[0]
        rows_per_mb = n_rows // s.mini_batches
        gen = torch.Generator().manual_seed(self._sampling_seed(stage=1))
        sums: dict[str, float] = {}
        n_updates = skipped = 0
        for _ in range(s.ppo_epochs):
            order = torch.randperm(n_rows, generator=gen) if s.mini_batches > 1 else torch.arange(n_rows)
            for mb in range(s.mini_batches):
                opt.zero_grad(set_to_none=True)
                mb_stats = self._backward(exp.rows(order[mb * rows_per_mb : (mb + 1) * rows_per_mb]))
                if mb_stats is None:  # a loss was not finite on some rank
                    skipped += 1
                    self._empty_step(opt)
                    continue
                grad_norm = self._grad_norm()
                if not self._all_ranks_finite(grad_norm):
                    skipped += 1
                    self._empty_step(opt, overflow=True)
                    continue
                opt.step()
                opt.zero_grad(set_to_none=True)  # the gradients' memory is free until the next backward
                n_updates += 1
                sums["train/grad_norm"] = sums.get("train/grad_norm", 0.0) + float(grad_norm)
                for k, v in mb_stats.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        stats = {k: v / max(n_updates, 1) for k, v in sums.items()}
        stats["train/skipped_updates"] = float(skipped)
        fp16 = master_optimizer(opt)
        if fp16 is not None:
            stats["train/loss_scale"] = fp16.loss_scale.scale
        return stats

    def _micro_batching(self, rows: int) -> bool:
        """Whether a mini-batch of ``rows`` rows runs as several micro-batches (``micro_batch_size``)."""
        size = self.settings.micro_batch_size
        return size is not None and size < rows

    def _backward(self, part: Experience) -> dict[str, float] | None:
        """Loss and backward of one mini-batch, its gradient accumulated over micro-batches of
        ``micro_batch_size`` rows; returns the loss's stats, or None (gradients cleared) as soon as a loss is not
        finite on some rank. Merged over micro-batches, ``LossOutput.shares`` stats add up, ``*_max`` stats
        take the largest, the others are averaged weighted by rows."""
        rows = part.rewards.shape[0]
        micro = self._micro_batching(rows)
        size = self.settings.micro_batch_size if micro else max(rows, 1)  # one pass over the whole mini-batch
        denominator = (  # the whole mini-batch's count; None: the loss counts its one (micro-)batch itself
            self.loss_fn.denominator(part.loss_mask, part.train_logprobs, part.rollout.rollout_logprobs)
            if micro
            else None
        )
        merged: dict[str, float] = {}
        for start in range(0, rows, size):
            index = torch.arange(start, min(start + size, rows))
            out = self._loss(part.rows(index) if micro else part, denominator=denominator)
            if not self._all_ranks_finite(out.loss.detach()):
                self.optimizers().zero_grad(set_to_none=True)
                return None
            self.manual_backward(self._scaled(out.loss))
            if not micro:
                return out.stats
            share = index.numel() / rows
            for k, v in out.stats.items():
                if k in out.shares:
                    merged[k] = merged.get(k, 0.0) + v
                elif k.endswith("_max"):
                    merged[k] = max(merged.get(k, -math.inf), v)
                else:
                    merged[k] = merged.get(k, 0.0) + share * v
        return merged

    @property
    def _loss_needs_entropy(self) -> bool:
        """Whether the loss differentiates the entropy (an entropy bonus)."""
        return bool(self.loss_fn.needs_entropy)

    def _loss(self, part: Experience, denominator: torch.Tensor | None = None) -> Any:
        """The loss of one mini-batch (or of a micro-batch, with the mini-batch's ``denominator``): every loss
        gets the same inputs and uses what it needs."""
        compute_entropy = self._loss_needs_entropy
        current = part.current
        if current is None:
            current = self.policy.batch_logprobs(part.rollout, self.sampling.temperature, compute_entropy)
        ref_lp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_lp = self.reference.batch_logprobs(part.rollout, self.sampling.temperature).logprobs
        return self.loss_fn(
            current.logprobs,
            part.train_logprobs,
            part.advantages,
            part.loss_mask,
            weights=part.weights,
            ref_logprobs=ref_lp,
            entropy=current.entropy if compute_entropy else None,
            denominator=denominator,
            rollout_logprobs=part.rollout.rollout_logprobs,
        )

    def _fsdp1_root(self) -> nn.Module | None:
        """The FSDP1 root around the policy (Lightning's ``FSDPStrategy``), else None (FSDP2, one process)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = self.trainer.strategy.model if self._trainer is not None else None
        return model if isinstance(model, FullyShardedDataParallel) else None

    def _full_state(self) -> list[tuple[str, torch.Tensor]]:
        """The policy's full weights and buffers for the engines (gathered out of FSDP1 or FSDP2); no snapshot
        copy: every engine's ``sync_weights`` copies them into its own model at once."""
        return self.policy.full_state_dict(fsdp_root=self._fsdp1_root(), snapshot=False)

    def _grad_norm(self) -> torch.Tensor:
        max_norm = self.settings.grad_clip if self.settings.grad_clip > 0 else math.inf
        root = self._fsdp1_root()
        if root is not None:  # FSDP1 shards flat parameters: only the root knows the global norm
            return root.clip_grad_norm_(max_norm)
        fp16 = master_optimizer(self.optimizers())
        if fp16 is not None:  # the unscaled fp32 gradients of the masters
            params = fp16.grad_params()
        else:
            params = [p for p in self.policy.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _count_bad_step(self, bad: bool, reason: str) -> None:
        """Consecutive bad steps; ``settings.max_bad_steps`` of them abort the run with the cause named."""
        self.bad_steps = self.bad_steps + 1 if bad else 0
        if self.bad_steps >= self.settings.max_bad_steps:
            raise RuntimeError(
                f"{self.bad_steps} consecutive rollout steps had {reason} (last at rollout step "
                f"{self.rollout_step}); they changed no weight or carried no signal. Check the task's reward "
                "function (its errors are logged), the sampling temperature, the rollout precision and the "
                "learning rate (algorithm.max_bad_steps sets this limit)."
            )

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
        prompts = batch["prompt"]
        fields = task_fields(batch)
        stage = self.apply_precision_schedule()
        alignment = self._check_fp32_alignment(prompts) if self.rollout_step == 0 else {}
        # pi_old's forward serves the loss when one optimizer step over the whole batch at once follows
        one_step = self.settings.optimizer_steps_per_rollout == 1 and not self._micro_batching(
            self.settings.prompts_per_step * self.settings.group_size
        )
        exp, stats = self.collect_experience(prompts, fields, keep_graph=one_step)
        stats.update(stage)
        stats.update(alignment)
        if exp is None:  # non-finite log-probs: nothing reaches the weights, the engine keeps its copy
            n = self.settings.optimizer_steps_per_rollout
            for _ in range(n):
                self._empty_step(self.optimizers())
            stats["train/skipped_updates"] = float(n)
            self.log_dict(stats, on_step=True, on_epoch=False, batch_size=len(prompts))
            self._count_bad_step(True, "non-finite log-probs on valid tokens")
            return
        t0 = time.perf_counter()
        stats.update(self.update_policy(exp))
        stats["time/update_s"] = time.perf_counter() - t0
        all_skipped = stats["train/skipped_updates"] == self.settings.optimizer_steps_per_rollout
        t1 = time.perf_counter()
        assert self.engine is not None
        self.engine.sync_weights(self._full_state())
        stats["time/sync_s"] = time.perf_counter() - t1

        # Metrics are synced across ranks by compute() (sum-reduced states), then reset per step.
        mismatch = {k: float(v) for k, v in self.mismatch.compute().items()}
        entropy = float(self.entropy_metric.compute())
        self.mismatch.reset()
        self.entropy_metric.reset()
        for name, metric in self.error_metrics.items():
            stats[f"errors/{name}"] = float(metric.compute())
            metric.reset()
        stats.update(mismatch)
        if self.routing_metrics is not None:  # beside the mismatch KL: routing/disagreement[_layer<i>]
            for name, metric in self.routing_metrics.items():
                stats[f"routing/{name}"] = float(metric.compute())
                metric.reset()
        stats["train/entropy"] = entropy
        self.log(
            "reward",
            stats["reward/mean"],
            prog_bar=True,
            on_step=True,
            on_epoch=False,
            batch_size=len(prompts),
        )
        self.log_dict(stats, on_step=True, on_epoch=False, batch_size=len(prompts))
        reward_min, reward_max = self._reward_range(exp.rewards)
        self._watch_constant_reward(reward_min, reward_max, exp, batch)
        self.history.append(
            {
                "step": float(self.rollout_step),
                "reward": stats["reward/mean"],
                "reward_min": reward_min,
                "reward_max": reward_max,
                "reward_failed": stats["reward/failed"],
                "kl_k3": mismatch.get("mismatch/kl_k3", float("nan")),
                "entropy": entropy,
                "lambda": stats.get("ais/lambda", float("nan")),
                **{name: stats[key] for name, key in self.HISTORY_STATS.items()},
            }
        )
        rewards_failed = stats["reward/failed"] >= exp.rewards.numel()
        reason = (
            "a reward function that failed on every sample"
            if rewards_failed
            else ("non-finite losses or gradients in every mini-batch")
        )
        self._count_bad_step(all_skipped or rewards_failed, reason)

    # ------------------------------------------------------- reward alarm
    def _reward_range(self, rewards: torch.Tensor) -> tuple[float, float]:
        """The smallest and the largest reward of this rollout step's trained samples, over every rank."""
        local = torch.stack([-rewards.min(), rewards.max()]).float()  # [2]
        both = self.trainer.strategy.reduce(local, reduce_op="max")
        return -float(both[0]), float(both[1])

    def _watch_constant_reward(
        self, low: float, high: float, exp: Experience, batch: dict[str, list], tol: float = 1e-6
    ) -> None:
        """Count the consecutive rollout steps whose samples all got one reward (the same value each step); at
        ``settings.constant_reward_steps`` of them log one WARNING with a sample of what the policy wrote."""
        alarm = self.reward_alarm
        if high - low > tol:
            alarm.update(streak=0, value=None)
            return
        if alarm["streak"] and alarm["value"] is not None and abs(alarm["value"] - low) <= tol:
            alarm["streak"] += 1
        else:
            alarm.update(streak=1, value=low, first_step=self.rollout_step)
        limit = self.settings.constant_reward_steps
        if not limit or alarm["warned"] or alarm["streak"] < limit:
            return
        alarm["warned"] = True
        if self.global_rank != 0:
            return
        row = int(exp.rollout.prompt_index[0])
        response = exp.rollout.response_ids[0][exp.rollout.response_mask[0]].tolist()
        completion = self.tokenizer.decode(response, skip_special_tokens=True)
        solution = batch.get("solution", ["?"] * (row + 1))[row]
        fired = "0 (the reward never fired)" if abs(low) <= tol else f"{low:g}"
        scored = any(a > 0 for v in self.validation_history for a in v.get("accuracy", {}).values())
        advice = (
            "Greedy validation answers did score, so the policy can answer in the task's format: sample more "
            "per step (algorithm.group_size, algorithm.prompts_per_step) or warm-start the policy"
            if scored
            else "If the policy cannot answer in the task's format, check task.format (chat for an "
            "instruction-tuned model prompted with policy.chat_template=true), task.extract (how the answer "
            "is read), algorithm.max_new_tokens, or warm-start the policy"
        )
        log.warning(
            "task %r: the reward was %s on every sample of %d consecutive rollout steps (steps %d-%d). "
            "GRPO's advantages are zero when every reward of a group is the same, so these steps learned "
            "nothing. A sample: prompt %s -> completion %s; reference solution %s. %s "
            "(algorithm.constant_reward_steps sets this check; 0 turns it off).",
            self.task.name or type(self.task).__name__,
            fired,
            alarm["streak"],
            alarm["first_step"],
            self.rollout_step,
            _clip(batch["prompt"][row]),
            _clip(completion),
            _clip(solution),
            advice,
        )

    def on_validation_epoch_start(self) -> None:
        self._val_tally, self._val_example = {}, None

    def on_validation_epoch_end(self) -> None:
        """Record this validation's accuracy per engine (over every rank) and its example in
        ``validation_history`` (not for Lightning's sanity check)."""
        if self.trainer.sanity_checking:
            return
        names = [
            n for n, engine in (("engine", self.engine), ("trainer", self.eval_engine)) if engine is not None
        ]
        if not names:
            return
        tallies = [self._val_tally.get(n, [0.0, 0.0]) for n in names]  # the same shape on every rank
        local = torch.tensor(tallies, dtype=torch.float64, device=self.device)
        total = self.trainer.strategy.reduce(local, reduce_op="sum").tolist()  # per engine: correct, prompts
        if not any(k for _, k in total):  # no prompt was scored
            return
        accuracy = {f"val/accuracy_{n}": float(c / max(k, 1.0)) for n, (c, k) in zip(names, total)}
        self.validation_history.append(
            {"step": self.rollout_step, "accuracy": accuracy, "example": dict(self._val_example or {})}
        )

    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        """Greedy accuracy with the engine's precision and with the trainer's precision."""
        prompts = batch["prompt"]
        fields = task_fields(batch)
        greedy = SamplingConfig(
            n=1,
            temperature=0.0,
            max_new_tokens=self.sampling.max_new_tokens,
            stop_token_ids=self.sampling.stop_token_ids,
        )
        engines = {"engine": self.engine, "trainer": self.eval_engine}
        done: dict[int, tuple[RolloutBatch, torch.Tensor]] = {}  # an engine serving both names runs once
        for name, engine in engines.items():
            if engine is None:
                continue
            if id(engine) not in done:
                out = ops.to_device(self._validation_generate(engine, prompts, greedy), self.device)
                done[id(engine)] = out, self.score(out, prompts, fields)[0]
            out, rewards = done[id(engine)]
            tally = self._val_tally.setdefault(name, [0.0, 0.0])
            tally[0] += float((rewards >= SOLVED_REWARD).sum())
            tally[1] += float(rewards.numel())
            if self._val_example is None and name == "engine":
                row = int(out.prompt_index[0])
                self._val_example = {
                    "prompt": prompts[row],
                    "completion": self.tokenizer.decode(
                        out.response_ids[0][out.response_mask[0]].tolist(), skip_special_tokens=True
                    ),
                    "solution": batch["solution"][row] if "solution" in batch else "",
                }
            self.log(f"val/reward_{name}", rewards.mean(), batch_size=len(prompts), sync_dist=True)
            self.log(
                f"val/accuracy_{name}",
                (rewards >= SOLVED_REWARD).float().mean(),
                batch_size=len(prompts),
                sync_dist=True,
            )

    def on_validation_start(self) -> None:
        if self.engine is None:  # validation before training (sanity check) or trainer.validate
            self.on_train_start()
        elif self.eval_engine is not None:
            self.eval_engine.sync_weights(self._full_state())
        # progressive precision: validate in the stage of the last step trained (the next step switches on)
        self.apply_precision_schedule(max(self.rollout_step - 1, 0))

    def close_engines(self) -> None:
        """Release the engines (each distinct one's ``close``: a vLLM engine's device memory); the next validation
        or training builds them again. A run's engines live from its first validation to its end: call this when
        the run ends (:meth:`engines_released`), so that the next run in the process starts with the memory free."""
        engines = {id(e): e for e in (self.engine, self.eval_engine) if e is not None}
        self.engine = self.eval_engine = None
        for engine in engines.values():
            engine.close()

    @contextlib.contextmanager
    def engines_released(self) -> Iterator[None]:
        """``with module.engines_released(): trainer.validate(...); trainer.fit(...)``: one set of engines for
        the whole run, released (:meth:`close_engines`) when the block ends, however it ends."""
        try:
            yield
        finally:
            self.close_engines()

    # ------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ais_history"] = list(self.history)
        checkpoint["ais_validation_start"] = dict(self.validation_start)
        checkpoint["ais_bad_steps"] = self.bad_steps
        checkpoint["ais_reward_alarm"] = dict(self.reward_alarm)
        checkpoint["ais_validation_history"] = list(self.validation_history)
        checkpoint["ais_engine_calibration"] = (
            self.engine.calibration_state() if self.engine is not None else None
        )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.history = list(checkpoint.get("ais_history", []))
        self.validation_start = dict(checkpoint.get("ais_validation_start", {}))
        self.bad_steps = int(checkpoint.get("ais_bad_steps", 0))
        self.reward_alarm.update(checkpoint.get("ais_reward_alarm", {}))
        self.validation_history = list(checkpoint.get("ais_validation_history", []))
        self._engine_calibration = checkpoint.get("ais_engine_calibration")


def _clip(text: str, limit: int = 160) -> str:
    """``repr`` of ``text``, cut to ``limit`` characters (for log messages)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def same_engine(a: EngineFactory, b: EngineFactory) -> bool:
    """Whether two engine factories build the same engine: the same object, or the same engine class with the same
    arguments after its ``check_args`` (:meth:`EngineSpec.same_engine_as`; an ``EngineSpec``'s checked arguments are
    the ones it was made with, a ``functools.partial``'s are checked now)."""
    if a is b:
        return True
    try:
        spec_a, spec_b = EngineSpec.of(a), EngineSpec.of(b)
    except (TypeError, ValueError):
        return False
    return spec_a is not None and spec_b is not None and spec_a.same_engine_as(spec_b)
