"""The update of one rollout batch: ``ppo_epochs`` passes of ``mini_batches`` optimizer steps, each gradient
accumulated over micro-batches of ``micro_batch_size`` rows, clipped, and skipped on every rank when a loss or a
gradient is not finite on one; a float16 policy's loss scaled and unscaled (:mod:`.mixed_precision`).

:class:`PolicyUpdate` is a part of ``GRPOModule`` (it reads the module's ``policy``, ``loss_fn``, ``reference``,
``settings``, ``sampling`` and Lightning's manual optimization), kept in its own file so that the module's file shows
the loop.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ais_lightning.modules.experience import Experience
from ais_lightning.modules.mixed_precision import master_optimizer


class PolicyUpdate:
    """The optimizer steps of a rollout batch, for a LightningModule with manual optimization (``GRPOModule``)."""

    # Read from the module: policy, loss_fn, reference, settings, sampling, _sampling_seed(); from Lightning:
    # optimizers(), manual_backward(), trainer.

    @property
    def _loss_needs_entropy(self) -> bool:
        """Whether the loss differentiates the entropy (an entropy bonus)."""
        return bool(self.loss_fn.needs_entropy)

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
            fp16 = master_optimizer(self.optimizers())
            self.manual_backward(fp16.scale_loss(out.loss) if fp16 is not None else out.loss)
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
        """The policy's full weights and buffers for the engines (gathered out of FSDP1 or FSDP2) where the gather
        leaves them (the trainer's device: no round trip through host memory); no snapshot copy: every consumer
        copies them into its own model (or a CPU snapshot) at once."""
        return self.policy.full_state_dict(fsdp_root=self._fsdp1_root(), snapshot=False, device=None)

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
