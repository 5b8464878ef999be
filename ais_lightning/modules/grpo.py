"""GRPOModule: GRPO on low-precision rollouts with an importance-sampling corrector.

The module only orchestrates; the math lives in reusable pieces:

    prompts --engine.generate--> RolloutBatch (mu log-probs, low precision)
            --task.reward-->      rewards --group_advantages--> A
            --policy (no grad)--> pi_old log-probs and entropy
            --corrector-->        IS weights, kept-token mask   (ais_lightning.correctors)
            --GRPOLoss over mini-batches--> optimizer steps     (ais_lightning.losses)
            --policy.full_state_dict--> engine.sync_weights

Manual optimization: one ``training_step`` is one rollout step and takes ``ppo_epochs *
mini_batches`` optimizer steps, so Lightning's ``global_step`` counts optimizer steps.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning import LightningModule
from torch import nn

from ais_lightning.diagnostics import ErrorTokenRate, MismatchDiagnostics, TokenEntropy
from ais_lightning.losses import GRPOLoss, TBPOLoss, group_advantages
from ais_lightning.policy import Policy
from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig
from ais_lightning.tasks import Task, safe_rewards

EngineFactory = Callable[[nn.Module], RolloutEngine]
"""Builds an engine from an unsharded copy of the policy's Hugging Face model."""


@dataclass
class Experience:
    """One rollout step, ready for the policy update (rows grouped by prompt).  All ``[B, T]`` unless noted."""

    rollout: RolloutBatch
    rewards: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B]
    old_logprobs: torch.Tensor  # pi_old (decoupled) or mu (bypass)
    weights: torch.Tensor | None  # corrector IS weights (decoupled), None in bypass mode
    loss_mask: torch.Tensor  # response_mask & corrector mask

    def rows(self, index: torch.Tensor) -> Experience:
        """The rows ``index`` of every tensor (for mini-batches)."""
        r = self.rollout
        sub = RolloutBatch(
            prompt_ids=r.prompt_ids[index],
            prompt_mask=r.prompt_mask[index],
            response_ids=r.response_ids[index],
            response_mask=r.response_mask[index],
            rollout_logprobs=r.rollout_logprobs[index],
            finish_reason=[r.finish_reason[i] for i in index.tolist()],
            prompt_index=r.prompt_index[index],
        )
        return Experience(
            rollout=sub,
            rewards=self.rewards[index],
            advantages=self.advantages[index],
            old_logprobs=self.old_logprobs[index],
            weights=None if self.weights is None else self.weights[index],
            loss_mask=self.loss_mask[index],
        )


class GRPOModule(LightningModule):
    """GRPO with a rollout engine and a corrector; every component is passed in built.

    Args:
        policy: the trainer's policy (high precision).
        tokenizer: Hugging Face tokenizer of the policy.
        task: prompts' reward function (``ais_lightning.tasks.Task``).
        corrector: ``NoCorrection`` / ``TIS`` / ``MIS`` / ``AIS`` (an nn.Module; its state is checkpointed).
        loss: the clipped surrogate (``GRPOLoss``; its ``mode`` decides decoupled vs bypass) or QaRL's
            ``TBPOLoss`` (sequence-level trust band on pi_old/mu, given the rollout log-probs).
        engine_factory: builds the rollout engine from an unsharded HF model (called once per rank).
        eval_engine_factory: builds a trainer-precision engine for validation (None = skip that half).
        group_size, max_new_tokens, temperature, top_p, top_k: sampling (vLLM names).
        advantage_scale: ``group`` | ``batch`` | ``none``.
        ppo_epochs, mini_batches: passes and optimizer steps per rollout batch.
        lr, weight_decay, grad_clip: AdamW and gradient-norm clipping (0 = off).
        kl_coef: k3 penalty to the initial policy (keeps a frozen copy when > 0).
        logprob_chunk_size: positions per chunk for log-prob/entropy computation.
        seed: base seed; rollout step s on rank r samples with a seed derived from (seed, s, r).
        fsdp_layers: attribute path of the decoder layers to shard with FSDP2 (``model.layers``).
    """

    def __init__(
        self,
        policy: Policy,
        tokenizer: Any,
        task: Task,
        corrector: nn.Module,
        loss: GRPOLoss | TBPOLoss,
        engine_factory: EngineFactory,
        eval_engine_factory: EngineFactory | None = None,
        group_size: int = 8,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        advantage_scale: str = "group",
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        kl_coef: float = 0.0,
        logprob_chunk_size: int = 1024,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = policy
        self.tokenizer = tokenizer
        self.task = task
        self.corrector = corrector
        self.loss_fn = loss
        self.engine_factory = engine_factory
        self.eval_engine_factory = eval_engine_factory
        self.group_size = group_size
        self.sampling = SamplingConfig(
            n=group_size,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            stop_token_ids=[tokenizer.eos_token_id],
        )
        self.advantage_scale = advantage_scale
        self.ppo_epochs = ppo_epochs
        self.mini_batches = mini_batches
        self.lr = lr
        self.weight_decay = weight_decay
        self.grad_clip = grad_clip
        self.kl_coef = kl_coef
        self.logprob_chunk_size = logprob_chunk_size
        self.seed = seed
        self.bypass = getattr(loss, "mode", "decoupled") == "bypass"
        self.reference = copy.deepcopy(policy).requires_grad_(False) if kl_coef > 0 else None
        self.mismatch = MismatchDiagnostics(prefix="mismatch/")
        self.entropy_metric = TokenEntropy()
        # QaRL's failure mode of quantized rollouts: degenerate, repetitive or garbled "error tokens".
        self.error_metrics = nn.ModuleDict(
            {
                "repeat_frac": ErrorTokenRate("repeat", min_ngram=2),
                "low_logprob_frac": ErrorTokenRate("low_logprob"),
            }
        )
        self.engine: RolloutEngine | None = None
        self.eval_engine: RolloutEngine | None = None
        self.history: list[dict[str, float]] = []
        """Per-rollout-step summary (reward, mismatch, lambda...), kept in checkpoints."""

    # ------------------------------------------------------------------ setup
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
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)

    def on_train_start(self) -> None:
        """Build the engines once the weights (possibly restored from a checkpoint) are in place."""
        state = self.policy.full_state_dict()
        self.engine = self._build_engine(self.engine_factory, state)
        if self.eval_engine_factory is not None:
            self.eval_engine = self._build_engine(self.eval_engine_factory, state)

    def _build_engine(self, factory: EngineFactory, state: list[tuple[str, torch.Tensor]]) -> RolloutEngine:
        fresh = self.policy.fresh_model()  # unsharded HF model of the same config, CPU
        engine = factory(fresh)
        engine.sync_weights(state)
        return engine

    # ---------------------------------------------------------------- rollout
    @property
    def rollout_step(self) -> int:
        """Rollout steps done so far (Lightning's global_step counts optimizer steps)."""
        return self.global_step // (self.ppo_epochs * self.mini_batches)

    def _sampling_seed(self, stage: int = 0) -> int:
        return (self.seed * 1_000_003 + self.rollout_step * 10_007 + self.global_rank * 101 + stage) % (2**31)

    def encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        return [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]

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
        return torch.as_tensor(rewards, dtype=torch.float32), int(n_failed)

    def _trainer_logprobs(
        self, batch: RolloutBatch, policy: nn.Module, compute_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = policy.response_logprobs(
            batch.prompt_ids,
            batch.prompt_mask,
            batch.response_ids,
            batch.response_mask,
            temperature=self.sampling.temperature,
            compute_entropy=compute_entropy,
            chunk_size=self.logprob_chunk_size,
        )
        return out.logprobs, out.entropy

    def collect_experience(
        self, prompts: list[str], fields: dict[str, list]
    ) -> tuple[Experience | None, dict[str, float]]:
        """Generate, score, compute advantages, pi_old and the corrector weights.

        Returns ``(None, stats)`` when any rank has non-finite log-probs on valid tokens: the step is
        skipped on every rank (the decision is all-reduced, so collectives stay matched).
        """
        assert self.engine is not None, "on_train_start builds the engine"
        t0 = time.perf_counter()
        sampling = dataclasses.replace(self.sampling, seed=self._sampling_seed())
        batch = self.engine.generate(self.encode_prompts(prompts), sampling)
        rollout_time = time.perf_counter() - t0

        rewards, n_failed = self.score(batch, prompts, fields)  # [B]
        advantages = group_advantages(rewards, self.group_size, scale=self.advantage_scale)  # [B]
        mask = batch.response_mask  # [B, T]
        with torch.no_grad():
            t1 = time.perf_counter()
            train_lp, entropy = self._trainer_logprobs(batch, self.policy, compute_entropy=True)  # [B, T]
            logprob_time = time.perf_counter() - t1

        stats = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(unbiased=False).item(),
            "reward/failed": float(n_failed),
            "response/length_mean": mask.sum(-1).float().mean().item(),
            "response/stop_frac": sum(r == "stop" for r in batch.finish_reason)
            / max(len(batch.finish_reason), 1),
            "time/rollout_s": rollout_time,
            "time/logprob_s": logprob_time,
            "throughput/rollout_tokens_per_s": batch.num_tokens / max(rollout_time, 1e-9),
        }
        valid_lp = torch.where(mask, train_lp + batch.rollout_logprobs, torch.zeros_like(train_lp))  # [B, T]
        finite = self._all_ranks_finite(valid_lp)
        stats["train/nonfinite_logprobs"] = float(not finite)
        if not finite:
            return None, stats

        # The same advantages and entropy as the corrector: mismatch/ais_lambda is the lambda AIS
        # would use (each metric takes only the arguments its update() accepts).
        self.mismatch.update(train_lp, batch.rollout_logprobs, mask, advantages=advantages, entropy=entropy)
        self.entropy_metric.update(entropy, mask)
        self.error_metrics["repeat_frac"].update(batch.response_ids, mask)
        self.error_metrics["low_logprob_frac"].update(train_lp, mask)
        correction = self.corrector(
            train_lp, batch.rollout_logprobs, mask, advantages=advantages, entropy=entropy
        )
        stats.update({k: float(v) for k, v in correction.stats.items()})
        if self.bypass:
            old_lp, weights, loss_mask = batch.rollout_logprobs, None, mask
        else:
            old_lp, weights, loss_mask = train_lp, correction.weights, correction.mask & mask
        return Experience(batch, rewards, advantages, old_lp, weights, loss_mask), stats

    # ----------------------------------------------------------------- update
    def _all_ranks_finite(self, value: torch.Tensor) -> bool:
        finite = bool(torch.isfinite(value).all())
        return bool(self.trainer.strategy.reduce_boolean_decision(finite, all=True))

    def update_policy(self, exp: Experience) -> dict[str, float]:
        """``ppo_epochs`` passes of ``mini_batches`` optimizer steps over one rollout batch."""
        opt = self.optimizers()
        n_rows = exp.rewards.shape[0]
        rows_per_mb = n_rows // self.mini_batches
        gen = torch.Generator().manual_seed(self._sampling_seed(stage=1))
        sums: dict[str, float] = {}
        n_updates = skipped = 0
        for _ in range(self.ppo_epochs):
            order = torch.randperm(n_rows, generator=gen) if self.mini_batches > 1 else torch.arange(n_rows)
            for mb in range(self.mini_batches):
                part = exp.rows(order[mb * rows_per_mb : (mb + 1) * rows_per_mb])
                out = self._loss(part)
                if not self._all_ranks_finite(out.loss.detach()):
                    skipped += 1
                    continue
                opt.zero_grad(set_to_none=True)
                self.manual_backward(out.loss)
                grad_norm = self._grad_norm()
                if not self._all_ranks_finite(grad_norm):
                    opt.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                opt.step()
                n_updates += 1
                sums["train/grad_norm"] = sums.get("train/grad_norm", 0.0) + float(grad_norm)
                for k, v in out.stats.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        stats = {k: v / max(n_updates, 1) for k, v in sums.items()}
        stats["train/skipped_updates"] = float(skipped)
        return stats

    def _loss(self, part: Experience) -> Any:
        """The loss of one mini-batch (GRPO's surrogate, or TBPO with the rollout log-probs)."""
        compute_entropy = getattr(self.loss_fn, "entropy_coef", 0.0) != 0
        logprobs, entropy = self._trainer_logprobs(part.rollout, self.policy, compute_entropy)
        if isinstance(self.loss_fn, TBPOLoss):
            return self.loss_fn(
                logprobs,
                part.old_logprobs,
                part.advantages,
                part.loss_mask,
                rollout_logprobs=part.rollout.rollout_logprobs,
            )
        ref_lp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_lp, _ = self._trainer_logprobs(part.rollout, self.reference, False)
        return self.loss_fn(
            logprobs,
            part.old_logprobs,
            part.advantages,
            part.loss_mask,
            weights=part.weights,
            ref_logprobs=ref_lp,
            entropy=entropy,
        )

    def _grad_norm(self) -> torch.Tensor:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
        prompts = batch["prompt"]
        fields = {k: v for k, v in batch.items() if k not in ("prompt", "solution")}
        exp, stats = self.collect_experience(prompts, fields)
        if exp is None:  # non-finite log-probs: nothing reaches the weights, the engine keeps its copy
            stats["train/skipped_updates"] = float(self.ppo_epochs * self.mini_batches)
            self.log_dict(stats, on_step=True, on_epoch=False, batch_size=len(prompts))
            return
        t0 = time.perf_counter()
        stats.update(self.update_policy(exp))
        stats["time/update_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        assert self.engine is not None
        self.engine.sync_weights(self.policy.full_state_dict())
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
        self.history.append(
            {
                "step": float(self.rollout_step),
                "reward": stats["reward/mean"],
                "kl_k3": mismatch.get("mismatch/kl_k3", float("nan")),
                "entropy": entropy,
                "lambda": stats.get("ais/lambda", float("nan")),
            }
        )

    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        """Greedy accuracy with the engine's precision and with the trainer's precision."""
        prompts = batch["prompt"]
        fields = {k: v for k, v in batch.items() if k not in ("prompt", "solution")}
        greedy = SamplingConfig(
            n=1,
            temperature=0.0,
            max_new_tokens=self.sampling.max_new_tokens,
            stop_token_ids=self.sampling.stop_token_ids,
        )
        engines = {"engine": self.engine, "trainer": self.eval_engine}
        for name, engine in engines.items():
            if engine is None:
                continue
            out = engine.generate(self.encode_prompts(prompts), greedy)
            rewards, _ = self.score(out, prompts, fields)
            self.log(f"val/reward_{name}", rewards.mean(), batch_size=len(prompts), sync_dist=True)
            self.log(
                f"val/accuracy_{name}",
                (rewards >= 1.0 - 1e-6).float().mean(),
                batch_size=len(prompts),
                sync_dist=True,
            )

    def on_validation_start(self) -> None:
        if self.engine is None:  # validation before training (sanity check) or trainer.validate
            self.on_train_start()
        elif self.eval_engine is not None:
            self.eval_engine.sync_weights(self.policy.full_state_dict())

    # ------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ais_history"] = list(self.history)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.history = list(checkpoint.get("ais_history", []))
