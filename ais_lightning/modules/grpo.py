"""GRPOModule: GRPO on low-precision rollouts with an importance-sampling corrector, synchronous or asynchronous.

The module only orchestrates one rollout step; the math lives in reusable pieces:

    prompts --source.rollouts--> rows of mu log-probs, each with the policy version that generated it
            --task.reward--> rewards --group_advantages--> A
            --policy--> pi_prox = pi_old at the current weights (its forward kept for the loss when one optimizer
                        step follows), and pi_v of stale rows: the mismatch split into precision and staleness
            --corrector--> IS weights and kept tokens of delta = log pi_prox - log mu  (ais_lightning.correctors)
            --update_policy--> optimizer steps (policy_update.py)  --source.publish--> the next policy version

The rollout source (``ais_lightning.rollout.sources``) decides which weights generate a step: the current ones
(``max_staleness=0``, the synchronous loop), those of exactly ``lag`` versions ago (the deterministic asynchronous
mode), or Ray workers that generate ahead while the trainer updates (``workers``). The trust region is always taken
against pi_prox (decoupled PPO), so every corrector corrects pi_prox / mu, stale or not (docs/async.md). One
``training_step`` is one rollout step of ``ppo_epochs * mini_batches`` optimizer steps (Lightning's
``global_step``); a step whose numbers are not finite changes no weight but counts, and ``max_bad_steps`` of them
in a row abort the run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from lightning import LightningModule
from torch import nn

from ais_lightning import ops
from ais_lightning.diagnostics import responses_within_error
from ais_lightning.losses import PolicyLoss, group_advantages
from ais_lightning.models.routing import moe_routers
from ais_lightning.modules.alignment_gate import fp32_alignment
from ais_lightning.modules.experience import Experience, rollout_stats, score_rows
from ais_lightning.modules.grpo_settings import GRPOSettings
from ais_lightning.modules.mixed_precision import build_optimizer
from ais_lightning.modules.policy_update import PolicyUpdate
from ais_lightning.modules.precision_schedule import apply_precision_schedule
from ais_lightning.modules.reward_alarm import ConstantRewardAlarm, constant_reward_warning, first_example
from ais_lightning.modules.rollout_engines import EngineFactory, RolloutEngines, build_engine
from ais_lightning.modules.staleness_step import StalenessStep
from ais_lightning.modules.step_metrics import StepMetrics
from ais_lightning.modules.step_record import history_entry, reward_range
from ais_lightning.modules.trainer_memory import leave_room_for_the_trainer
from ais_lightning.modules.validation import GRPOValidation, ValidationTally
from ais_lightning.policy import Policy
from ais_lightning.policy.gather import shard_by_layers
from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig
from ais_lightning.rollout.factory import same_engine
from ais_lightning.rollout.prompts import PromptEncoder
from ais_lightning.rollout.sources import RolloutRequest, RolloutSource
from ais_lightning.tasks import Task, task_fields

__all__ = ["EngineFactory", "Experience", "GRPOModule", "GRPOSettings", "same_engine"]

log = logging.getLogger(__name__)


class GRPOModule(PolicyUpdate, GRPOValidation, LightningModule):
    """GRPO with a rollout source and a corrector; every component is passed in built.

    Args:
        policy: the trainer's policy (high precision), with its ``tokenizer``.
        task: the prompts' reward function (``ais_lightning.tasks.Task``).
        corrector: ``NoCorrection`` / ``TIS`` / ``MIS`` / ``AIS`` ... (an nn.Module; its state is checkpointed).
        loss: a policy loss, an ``ais_lightning.losses.PolicyLoss`` (``GRPOLoss``, QaRL's ``TBPOLoss``, ...); it
            gets pi_old, mu and the corrector's weights and uses what it needs.
        engine_factory: builds the rollout engine (a ``RolloutEngine``) from an unsharded model, once per rank: an
            ``EngineSpec`` (what ``ais-train`` passes, its checks already run), a ``functools.partial`` of an engine
            class, or any callable.
        settings: GRPO's loop settings (``GRPOSettings``; ``max_staleness`` and the rest of the asynchronous mode).
        eval_engine_factory: builds a trainer-precision engine for validation (None = skip that half).
        seed: base seed; rollout step s on rank r samples with a seed derived from (seed, s, r).
        workers: where rollouts are generated besides this process: None (the in-process engine) or rollout workers
            with a ``build_source`` method (``ais_lightning.rollout.ray_workers.RayWorkers``).
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
        workers: Any = None,
    ) -> None:
        super().__init__()
        if policy.tokenizer is None:
            raise ValueError(
                "policy.tokenizer is None: the GRPO module encodes prompts with the policy's tokenizer"
            )
        from ais_lightning.policy.builders import check_aligned_schedule_engine

        check_aligned_schedule_engine(policy.aligned_schedule, engine_factory)
        self.automatic_optimization = False
        self.policy, self.task, self.corrector, self.loss_fn = policy, task, corrector, loss
        settings = settings if settings is not None else GRPOSettings()
        if settings.max_new_tokens is None:  # the task's budget (ais-train settles it at validation already)
            settings = dataclasses.replace(settings, max_new_tokens=task.response_budget())
        self.settings, self.seed, self.workers = settings, seed, workers
        s = self.settings
        self.sampling = s.sampling(policy.tokenizer.eos_token_id)
        self.reference = copy.deepcopy(policy).requires_grad_(False) if loss.needs_reference else None
        async_mode = s.max_staleness > 0 or workers is not None
        self.staleness = StalenessStep(policy, s, loss.trust_region) if async_mode else None
        """The asynchronous mode's bookkeeping (snapshots, pi_v, the bound); None in the synchronous loop."""
        split = self.staleness is not None and self.staleness.scorer is not None
        self.step_metrics = StepMetrics(len(moe_routers(policy.model)), split, corrector.diagnostic_params())
        self.engines = RolloutEngines(engine_factory, eval_engine_factory)
        self.bad_steps = 0  # consecutive rollout steps whose numbers were not finite
        self.history: list[dict[str, float]] = []  # per rollout step (history_entry), checkpointed
        self.validation_start: dict[str, float] = {}  # before any update (the caller sets it), checkpointed
        self.alarm = ConstantRewardAlarm(s.constant_reward_steps)
        self.prompt_encoder = PromptEncoder(policy, s.max_new_tokens, s.truncate_prompts)
        self.validation = ValidationTally()
        self._step_started: float | None = None

    tokenizer = property(lambda self: self.policy.tokenizer)

    @property
    def mismatch(self) -> Any:
        """The step's ``MismatchDiagnostics`` (``mismatch/*``)."""
        return self.step_metrics.mismatch

    @property
    def reward_alarm(self) -> dict[str, Any]:
        """The constant-reward alarm's state (:class:`ConstantRewardAlarm`), kept in checkpoints."""
        return self.alarm.state

    # ------------------------------------------------------------------ setup
    def setup(self, stage: str) -> None:
        """QaRL's aligned forward, if the policy asks for it (after any warm start, before sharding)."""
        self.policy.apply_aligned_quantization()

    def configure_model(self) -> None:
        """FSDP2 (Lightning ``ModelParallelStrategy``): shard every decoder layer, then the policy."""
        mesh = getattr(self, "device_mesh", None)
        if mesh is not None:
            shard_by_layers(self.policy, mesh["data_parallel"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over the policy's parameters; for a float16 policy, on fp32 master weights with a dynamic loss
        scale (:func:`ais_lightning.modules.mixed_precision.build_optimizer`; unsharded models only)."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        s = self.settings
        adamw = functools.partial(torch.optim.AdamW, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)
        sharded = self._fsdp1_root() is not None or any(type(p).__name__ == "DTensor" for p in params)
        if sharded and any(p.dtype == torch.float16 for p in params):
            raise ValueError(
                "policy.dtype=float16 (fp32 master weights and a loss scale) is not supported with sharded "
                "strategies yet (trainer.strategy): use trainer.strategy=auto, or policy.dtype=bfloat16"
            )
        return build_optimizer(params, adamw)

    # ---------------------------------------------------------------- engines
    def on_train_start(self) -> None:
        """Build (or give the current weights to) the engines and the rollout source
        (:class:`~ais_lightning.modules.rollout_engines.RolloutEngines`) once the weights, possibly a checkpoint's, are
        in place."""
        state, version = self._full_state(), self.rollout_step
        self.engines.build_or_sync(self._build_engine, state)
        self.apply_precision_schedule()  # a resumed run lands in the stage of its step
        self.engines.restore_calibration()
        if self.staleness is not None:
            self.staleness.keep(version, state)
        self.engines.start_source(
            version, state, self.settings, self.staleness, self.workers, self.seed, self.policy.fresh_model
        )

    def _build_engine(self, factory: EngineFactory, state: list[tuple[str, torch.Tensor]]) -> RolloutEngine:
        """``factory`` on a fresh model (an engine that claims a share of the device, vLLM, leaves room for the
        optimizer states and gradients still to come); a seam that tools and tests wrap."""
        optimizers = self.trainer.optimizers if self._trainer is not None else []
        factory = leave_room_for_the_trainer(factory, self.policy.parameters(), optimizers)
        return build_engine(factory, lambda: self.policy.fresh_model().to(self.device), state)

    @property
    def engine(self) -> RolloutEngine | None:
        """The rollout engine in this process (it generates in the in-process modes; validation samples with it)."""
        return self.engines.engine

    @property
    def eval_engine(self) -> RolloutEngine | None:
        """The trainer-precision engine that validation also samples with (None without its factory)."""
        return self.engines.eval_engine

    @property
    def source(self) -> RolloutSource | None:
        """Where the rollouts come from (``ais_lightning.rollout.sources``)."""
        return self.engines.source

    def apply_precision_schedule(self, step: int | None = None) -> dict[str, float]:
        """Progressive precision (``policy.aligned_schedule``): the aligned forward and the rollout engine in the
        stage of rollout step ``step`` (default: the next one to train); see
        :func:`ais_lightning.modules.precision_schedule.apply_precision_schedule`."""
        return apply_precision_schedule(self.policy, self.engine, self.rollout_step if step is None else step)

    def close_engines(self) -> None:
        """Release the rollout source (its workers) and the engines (the next validation or training builds them)."""
        self.engines.close()

    @contextlib.contextmanager
    def engines_released(self) -> Iterator[None]:
        """``with module.engines_released(): trainer.validate(...); trainer.fit(...)``: one set of engines for the
        run, released when the block ends, however it ends."""
        try:
            yield
        finally:
            self.close_engines()

    @property
    def rollout_step(self) -> int:
        """Rollout steps done so far (Lightning's global_step counts optimizer steps); also the policy version of
        the current weights."""
        return self.global_step // self.settings.optimizer_steps_per_rollout

    def _sampling_seed(self, stage: int = 0, step: int | None = None) -> int:
        step = self.rollout_step if step is None else step
        return (self.seed * 1_000_003 + step * 10_007 + self.global_rank * 101 + stage) % (2**31)

    def encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        """The policy's token ids of ``prompts``, fitted to the context (``ais_lightning.rollout.prompts.PromptEncoder``)."""
        return self.prompt_encoder(prompts)

    def score(
        self, batch: RolloutBatch, prompts: list[str], fields: dict[str, list]
    ) -> tuple[torch.Tensor, int]:
        """Rewards of every row (``[B]``; rows answer ``prompts[batch.prompt_index]``); failures score 0, counted."""
        rewards, n_failed = score_rows(self.task, self.tokenizer, batch, prompts, fields)
        return torch.as_tensor(rewards, dtype=torch.float32, device=self.device), n_failed

    def generate_rollouts(
        self,
        prompts: list[str],
        sampling: SamplingConfig | None = None,
        engine: RolloutEngine | None = None,
        **generate_kwargs: Any,
    ) -> RolloutBatch:
        """``engine``'s responses (default: the in-process rollout engine) to ``prompts`` on this device; ``sampling``
        defaults to GRPO's seeded by step and rank; ``generate_kwargs`` go to ``generate`` (Sol-RL's ``uniforms``)."""
        engine = self.engine if engine is None else engine
        assert engine is not None, "on_train_start builds the engine"
        if sampling is None:
            sampling = dataclasses.replace(self.sampling, seed=self._sampling_seed())
        return ops.to_device(
            engine.generate(self.encode_prompts(prompts), sampling, **generate_kwargs), self.device
        )

    def _request(self, prompts: list[str], step: int) -> RolloutRequest:
        seed = self._sampling_seed(step=step)
        return RolloutRequest(self.encode_prompts(prompts), dataclasses.replace(self.sampling, seed=seed))

    def collect_experience(
        self, prompts: list[str], fields: dict[str, list], keep_graph: bool = False
    ) -> tuple[Experience | None, dict[str, float]]:
        """This step's rollouts from the source (the next steps' requested ahead when it generates ahead), then
        rewards, advantages, pi_old and the corrector weights (:meth:`build_experience`); the stats also time the
        generation (the time this process waited for it, with rollout workers)."""
        assert self.source is not None, "on_train_start builds the rollout source"
        step = self.rollout_step
        for ahead, batch in enumerate(self._upcoming_batches(self.source.lookahead()), start=1):
            self.source.submit(step + ahead, self._request(batch["prompt"], step + ahead))
        t0 = time.perf_counter()
        rollouts = self.source.rollouts(step, self._request(prompts, step), version=step)
        rollout_time = time.perf_counter() - t0
        batch = ops.to_device(rollouts.batch, self.device)
        exp, stats = self.build_experience(
            batch, prompts, fields, keep_graph, versions=rollouts.versions, dropped=rollouts.dropped
        )
        stats["time/rollout_s"] = rollout_time
        stats["throughput/rollout_tokens_per_s"] = batch.num_tokens / max(rollout_time, 1e-9)
        stats.update(self.source.stats())
        return exp, stats

    def _upcoming_batches(self, n: int) -> list[dict[str, list]]:
        """The prompt batches of the next ``n`` steps, when the train loader can tell them without moving
        (``ais_lightning.tasks.PromptStream.upcoming``); none otherwise (a source then generates on demand)."""
        from ais_lightning.tasks.datamodule import PromptStream

        stream = self.trainer.train_dataloader if n > 0 else None
        return stream.upcoming(n) if isinstance(stream, PromptStream) else []

    def build_experience(
        self,
        batch: RolloutBatch,
        prompts: list[str],
        fields: dict[str, list],
        keep_graph: bool = False,
        versions: torch.Tensor | None = None,
        dropped: int = 0,
    ) -> tuple[Experience | None, dict[str, float]]:
        """Score a generated ``batch`` (rows answer ``prompts[batch.prompt_index]``, groups of ``group_size`` contiguous
        rows), compute advantages, pi_old and the corrector weights, and update the step's metrics. ``keep_graph``: keep
        pi_old's forward for the loss (``Experience.current``; exact when one optimizer step follows). ``versions``
        (``[B]``, each row's generating version) and ``dropped`` (rows discarded as too stale): the asynchronous mode's
        staleness and split of the mismatch. ``(None, stats)`` when some rank has non-finite log-probs on valid tokens:
        the step is skipped on every rank (an all-reduced decision, so collectives stay matched)."""
        rewards, n_failed = self.score(batch, prompts, fields)  # [B]
        mask = batch.response_mask  # [B, T]
        t1 = time.perf_counter()
        pi_old = self._trainer_logprobs(batch, keep_graph)
        stats = {**rollout_stats(batch, rewards, n_failed), "time/logprob_s": time.perf_counter() - t1}
        # [B, T] each, values only: the corrector and the metrics never differentiate them
        train_lp, entropy, impurity = (t.detach() for t in (pi_old.logprobs, pi_old.entropy, pi_old.impurity))
        valid_lp = torch.where(mask, train_lp + batch.rollout_logprobs, torch.zeros_like(train_lp))  # [B, T]
        finite = self._all_ranks_finite(valid_lp)
        stats["train/nonfinite_logprobs"] = float(not finite)
        if not finite:
            return None, stats
        stale = None  # the asynchronous mode: staleness, and pi_v for the split of the mismatch
        if self.staleness is not None and versions is not None:
            stale = self.staleness.measure(
                batch, versions, self.rollout_step, train_lp, dropped, self.trainer
            )
            stats.update(stale.stats)

        # Responses too mismatched to train on (seq_logprob_error_threshold) leave before the advantages: out of
        # their group's baseline, the corrector's batch and the loss. The mismatch metrics still see them.
        s = self.settings
        keep = responses_within_error(train_lp, batch.rollout_logprobs, mask, s.seq_logprob_error_threshold)
        if keep is not None:
            stats["train/dropped_by_logprob_error"] = float((~keep).sum())  # this rank
        advantages = group_advantages(rewards, s.group_size, scale=s.advantage_scale, valid=keep)  # [B]
        train_mask = mask if keep is None else mask & keep.unsqueeze(-1)  # [B, T]
        # delta = log pi_old - log mu, once: the corrector and every mismatch metric read it.
        delta = ops.log_ratio(train_lp, batch.rollout_logprobs, mask)  # [B, T]
        routing = (
            self.policy.routing_replay.last_routing() if self.policy.routing_replay is not None else None
        )
        own_routing = (
            routing[0] if routing is not None else None
        )  # the trainer's own experts in pi_old's forward
        self.step_metrics.update(batch, train_lp, delta, advantages, entropy, impurity, stale, own_routing)
        stale_delta = stale.log_ratio if stale is not None else None
        masked = (
            (lambda t: t) if keep is None else (lambda t: torch.where(train_mask, t, torch.zeros_like(t)))
        )
        correction = self.corrector.from_log_ratio(
            masked(delta),
            train_mask,
            advantages=advantages,
            entropy=entropy,
            train_logprobs=train_lp,
            rollout_logprobs=batch.rollout_logprobs,
            impurity=impurity,
            stale_log_ratio=masked(stale_delta) if stale_delta is not None else None,
        )
        stats.update(correction.stats)
        kept = correction.mask & train_mask
        current = pi_old if keep_graph else None
        return Experience(batch, rewards, advantages, train_lp, correction.weights, kept, current), stats

    def _trainer_logprobs(self, batch: RolloutBatch, keep_graph: bool) -> Any:
        """pi_old of ``batch``'s tokens with entropy and impurity (with autograd when ``keep_graph``; the entropy's only
        when the loss differentiates it), its MoE routing replayed from the engine's when ``policy.router_replay``."""
        if self.policy.router_replay and batch.routing is None:
            raise ValueError(
                f"policy.router_replay=true, but the rollout engine ({type(self.engine).__name__}) returned no routing "
                "(RolloutBatch.routing): use an engine that records it (TorchRolloutEngine) or router_replay=false"
            )
        with torch.set_grad_enabled(keep_graph):
            return self.policy.batch_logprobs(
                batch, self.sampling.temperature, compute_entropy=True, entropy_grad=self._loss_needs_entropy
            )

    def _check_fp32_alignment(self, prompts: list[str]) -> dict[str, float]:
        """The optional gate ``max_fp32_mult_prob_error`` (:func:`ais_lightning.modules.alignment_gate.fp32_alignment`);
        ``{}`` when it is off."""
        limit = self.settings.max_fp32_mult_prob_error
        if limit is None:
            return {}
        sampling, ids = (
            dataclasses.replace(self.sampling, seed=self._sampling_seed(stage=2)),
            self.encode_prompts(prompts),
        )
        return fp32_alignment(self.eval_engine, self.policy, ids, sampling, limit, self._all_ranks_finite)

    def _publish(self, changed: bool) -> None:
        """The weights after a rollout step's update become the next policy version, for the rollout source (and
        the snapshots of an asynchronous run). ``changed`` False: no weight moved (a skipped step)."""
        assert self.source is not None
        version = self.rollout_step
        if not changed and self.staleness is None:  # the synchronous loop: the engine keeps its copy
            self.source.engine_version = version
            return
        state = self._full_state()
        if self.staleness is not None:
            self.staleness.keep(version, state)
        self.source.publish(version, state)

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
        prompts, started, self._step_started = batch["prompt"], self._step_started, time.perf_counter()
        stage = self.apply_precision_schedule()
        alignment = self._check_fp32_alignment(prompts) if self.rollout_step == 0 else {}
        # pi_old's forward serves the loss when one optimizer step over the whole batch at once follows
        one_step = self.settings.optimizer_steps_per_rollout == 1 and not self._micro_batching(
            self.settings.prompts_per_step * self.settings.group_size
        )
        exp, stats = self.collect_experience(prompts, task_fields(batch), keep_graph=one_step)
        if started is not None:  # wall time from the previous step's start: steps per second
            stats["time/step_s"] = self._step_started - started
        stats.update(stage)
        stats.update(alignment)
        if exp is None:  # non-finite log-probs: nothing reaches the weights
            n = self.settings.optimizer_steps_per_rollout
            for _ in range(n):
                self._empty_step(self.optimizers())
            self._publish(changed=False)
            stats["train/skipped_updates"] = float(n)
            self.log_dict(stats, on_step=True, on_epoch=False, batch_size=len(prompts))
            self._count_bad_step(True, "non-finite log-probs on valid tokens")
            return
        t0 = time.perf_counter()
        stats.update(self.update_policy(exp))
        stats["time/update_s"] = time.perf_counter() - t0
        all_skipped = stats["train/skipped_updates"] == self.settings.optimizer_steps_per_rollout
        t1 = time.perf_counter()
        self._publish(changed=True)
        stats["time/sync_s"] = time.perf_counter() - t1
        stats.update(self.step_metrics.compute_and_reset())  # synced across ranks, then reset per step
        per_step = {"on_step": True, "on_epoch": False, "batch_size": len(prompts)}
        self.log("reward", stats["reward/mean"], prog_bar=True, **per_step)
        if "async/queue_depth" in stats:  # rollout workers: how many steps of rollouts wait ahead
            self.log("queue", stats["async/queue_depth"], prog_bar=True, **per_step)
        self.log_dict(stats, **per_step)
        reward_min, reward_max = reward_range(exp.rewards, self.trainer.strategy)
        if self.alarm.observe(reward_min, reward_max, self.rollout_step):
            self._warn_constant_reward(exp, batch)
        extra = {
            **self.HISTORY_STATS,
            **(self.staleness.HISTORY_STATS if self.staleness is not None else {}),
            **self.source.HISTORY_STATS,
        }
        self.history.append(history_entry(self.rollout_step, stats, reward_min, reward_max, extra))
        rewards_failed = stats["reward/failed"] >= exp.rewards.numel()
        reason = (
            "a reward function that failed on every sample"
            if rewards_failed
            else ("non-finite losses or gradients in every mini-batch")
        )
        self._count_bad_step(all_skipped or rewards_failed, reason)

    def _warn_constant_reward(self, exp: Experience, batch: dict[str, list]) -> None:
        """The constant-reward alarm's WARNING (rank 0), with a sample of what the policy wrote."""
        if self.global_rank == 0:
            example = first_example(exp.rollout, batch, self.tokenizer)
            scored = any(a > 0 for v in self.validation_history for a in v.get("accuracy", {}).values())
            task = self.task.name or type(self.task).__name__
            log.warning(constant_reward_warning(task, self.alarm.state, self.rollout_step, example, scored))

    # ------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ais_history"] = list(self.history)
        checkpoint["ais_validation_start"] = dict(self.validation_start)
        checkpoint["ais_bad_steps"] = self.bad_steps
        checkpoint["ais_reward_alarm"] = dict(self.alarm.state)
        checkpoint["ais_validation_history"] = list(self.validation_history)
        checkpoint["ais_engine_calibration"] = (
            self.engine.calibration_state() if self.engine is not None else None
        )
        if self.staleness is not None:
            checkpoint["ais_staleness"] = self.staleness.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.history = list(checkpoint.get("ais_history", []))
        self.validation_start = dict(checkpoint.get("ais_validation_start", {}))
        self.bad_steps = int(checkpoint.get("ais_bad_steps", 0))
        self.alarm.state.update(checkpoint.get("ais_reward_alarm", {}))
        self.validation_history = list(checkpoint.get("ais_validation_history", []))
        self.engines.calibration = checkpoint.get("ais_engine_calibration")
        if self.staleness is not None and "ais_staleness" in checkpoint:
            self.staleness.load_state_dict(checkpoint["ais_staleness"])
