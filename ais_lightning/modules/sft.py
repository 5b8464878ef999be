"""SFTModule: supervised warm-start of a policy on a task's reference solutions.

RL from a random tiny model sees zero reward; a short SFT run gives it a non-zero start.
The loss is the mean negative log-likelihood of the solution tokens (and the EOS that ends
them) given the prompt, computed by the same ``Policy.response_logprobs`` the RL trainer uses.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning import LightningModule

from ais_lightning.ops import masked_mean, pad_sequences
from ais_lightning.policy import Policy


def encode_pairs(
    tokenizer: Any, prompts: list[str], completions: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded, completions + EOS right-padded: the RolloutBatch layout."""
    pad = tokenizer.pad_token_id
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    responses = [
        tokenizer.encode(c, add_special_tokens=False) + [tokenizer.eos_token_id] for c in completions
    ]
    p_ids, p_mask = pad_sequences(prompt_ids, pad, "left")
    r_ids, r_mask = pad_sequences(responses, pad, "right")
    return p_ids, p_mask, r_ids, r_mask


class SFTModule(LightningModule):
    """Cross-entropy on ``solution`` given ``prompt`` (batches from ``PromptDataModule``)."""

    def __init__(self, policy: Policy, tokenizer: Any, lr: float = 3e-3, warmup_steps: int = 50) -> None:
        super().__init__()
        self.policy = policy
        self.tokenizer = tokenizer
        self.lr = lr
        self.warmup_steps = warmup_steps

    def training_step(self, batch: dict[str, list], batch_idx: int) -> torch.Tensor:
        p_ids, p_mask, r_ids, r_mask = encode_pairs(self.tokenizer, batch["prompt"], batch["solution"])
        out = self.policy.response_logprobs(
            p_ids, p_mask, r_ids, r_mask, temperature=1.0, compute_entropy=False
        )
        loss = -masked_mean(out.logprobs, r_mask)
        self.log("sft/loss", loss, prog_bar=True, batch_size=len(batch["prompt"]))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.policy.parameters(), lr=self.lr, weight_decay=0.0)
        total = max(self.trainer.max_steps, 1)
        warm = min(self.warmup_steps, total)

        def schedule(step: int) -> float:  # linear warm-up, cosine decay to 10%
            if step < warm:
                return (step + 1) / warm
            progress = (step - warm) / max(total - warm, 1)
            return 0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
