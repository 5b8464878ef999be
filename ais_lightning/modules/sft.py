"""SFTModule: supervised warm start of a policy on a task's reference solutions.

RL from a random tiny model sees zero reward; a short SFT run gives it a non-zero start. The loss is
the policy's own ``sft_loss``: for a causal LM the mean negative log-likelihood of the solution tokens
(and the EOS that ends them) given the prompt, computed by the same ``Policy.response_logprobs`` the RL
trainer uses; for a masked-diffusion LM the masked-denoising loss over the completion.

The schedule is deliberately plain: AdamW, a linear warm-up to ``lr``, then a constant ``lr`` (the
warm start of :mod:`ais_lightning.app.warmstart` stops when an accuracy target is met, at a step not
known in advance, so there is no horizon to decay towards), and global gradient-norm clipping,
which keeps the occasional loss spike of a tiny model at a moderate lr from undoing what it learned.
The module runs under a Lightning ``Trainer`` (``training_step``, ``configure_optimizers``,
``configure_gradient_clipping``) or step by step through :meth:`SFTModule.train_step`. A float16 policy trains
with fp32 master weights and a dynamic loss scale (:mod:`ais_lightning.modules.mixed_precision`): a step whose
gradients overflow is skipped and backs off the scale.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from lightning import LightningModule

from ais_lightning.models.prompting import encode_prompts
from ais_lightning.modules.mixed_precision import build_optimizer, master_optimizer
from ais_lightning.ops import pad_sequences
from ais_lightning.policy import Policy


def encode_pairs(
    tokenizer: Any, prompts: list[str], completions: list[str], chat_template: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded (raw or in the chat template: :func:`ais_lightning.models.prompting.encode_prompts`),
    completions + EOS right-padded: the RolloutBatch layout."""
    pad = tokenizer.pad_token_id
    prompt_ids = encode_prompts(tokenizer, prompts, chat_template)
    responses = [
        tokenizer.encode(c, add_special_tokens=False) + [tokenizer.eos_token_id] for c in completions
    ]
    p_ids, p_mask = pad_sequences(prompt_ids, pad, "left")  # [B, P]
    r_ids, r_mask = pad_sequences(responses, pad, "right")  # [B, T]
    return p_ids, p_mask, r_ids, r_mask


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Learning-rate multiplier of optimizer step ``step`` (0-based): ``(step + 1) / warmup_steps`` during
    the warm-up, then 1 (``warmup_steps == 0``: always 1)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if step >= warmup_steps:
        return 1.0
    return (step + 1) / warmup_steps


class SFTModule(LightningModule):
    """Cross-entropy on ``solution`` given ``prompt`` (batches from ``PromptDataModule``).

    Args:
        policy: the policy to train.
        tokenizer: its tokenizer (``pad_token_id`` and ``eos_token_id`` are used).
        lr: AdamW learning rate after the warm-up.
        warmup_steps: steps of linear warm-up (see :func:`warmup_factor`).
        weight_decay: AdamW weight decay.
        grad_clip: max global gradient norm (0 = off); applied by ``configure_gradient_clipping`` under a
            Trainer (a Trainer's own ``gradient_clip_val`` takes precedence) and by :meth:`train_step`.
    """

    def __init__(
        self,
        policy: Policy,
        tokenizer: Any,
        lr: float = 1e-3,
        warmup_steps: int = 50,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
    ) -> None:
        super().__init__()
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 = off), got {grad_clip}")
        self.policy = policy
        self.tokenizer = tokenizer
        self.lr = lr
        self.warmup_steps = warmup_steps
        self.weight_decay = weight_decay
        self.grad_clip = grad_clip

    def sft_loss(self, batch: dict[str, list]) -> torch.Tensor:
        """The policy's own supervised loss on the batch's solutions (``Policy.sft_loss``: the mean NLL of the
        solution tokens + EOS for a causal LM, the masked-denoising bound for a diffusion LM; a scalar)."""
        p_ids, p_mask, r_ids, r_mask = encode_pairs(
            self.tokenizer, batch["prompt"], batch["solution"], self.policy.chat_template
        )
        return self.policy.sft_loss(p_ids, p_mask, r_ids, r_mask)

    def training_step(self, batch: dict[str, list], batch_idx: int) -> torch.Tensor:
        loss = self.sft_loss(batch)
        self.log("sft/loss", loss, prog_bar=True, batch_size=len(batch["prompt"]))
        return loss

    def build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the policy's parameters at ``lr`` (on fp32 master weights for a float16 policy:
        :func:`ais_lightning.modules.mixed_precision.build_optimizer`)."""
        adamw = functools.partial(torch.optim.AdamW, lr=self.lr, weight_decay=self.weight_decay)
        return build_optimizer(self.policy.parameters(), adamw)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Under a Trainer: backward of the loss, times a float16 policy's loss scale."""
        fp16 = master_optimizer(self.optimizers()) if self._trainer is not None else None
        super().backward(fp16.scale_loss(loss) if fp16 is not None else loss, *args, **kwargs)

    def configure_optimizers(self) -> Any:
        opt = self.build_optimizer()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_factor(step, self.warmup_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        clip = gradient_clip_val if gradient_clip_val is not None else self.grad_clip
        fp16 = master_optimizer(optimizer)
        if clip and fp16 is not None:  # the masters' unscaled gradients (Lightning's reads the scaled)
            torch.nn.utils.clip_grad_norm_(fp16.grad_params(), clip)
        elif clip:
            self.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")

    def train_step(self, optimizer: torch.optim.Optimizer, batch: dict[str, list], lr: float) -> float:
        """One optimizer step outside a Trainer at learning rate ``lr``; returns the loss."""
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss = self.sft_loss(batch)
        fp16 = master_optimizer(optimizer)
        (fp16.scale_loss(loss) if fp16 is not None else loss).backward()
        if self.grad_clip:
            params = fp16.grad_params() if fp16 is not None else self.policy.parameters()
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        optimizer.step()  # a float16 policy's step is skipped when its gradients overflow
        return float(loss.detach())
