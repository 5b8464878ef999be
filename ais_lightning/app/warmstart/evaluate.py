"""The warm start's measure: greedy accuracy of a policy on held-out prompts, as the RL validation reads it."""

from __future__ import annotations

from typing import Any

import torch

from ais_lightning.models.prompting import encode_prompts
from ais_lightning.policy import Policy
from ais_lightning.tasks import SOLVED_REWARD, Task, TaskSample, batch_rewards

__all__ = ["GreedyAccuracy"]


class GreedyAccuracy:
    """Greedy accuracy of a policy on fixed prompts: the share whose task reward is >= 1.

    Responses come from the policy's fp32 engine (``policy.build_engine("fp32")``: the engine the RL
    validation uses for the trainer's precision; the LLaDA sampler for a diffusion policy) at temperature 0,
    stopped at EOS; rewards through ``batch_rewards`` (``safe_rewards``) with the
    samples' fields, like the RL validation.
    """

    def __init__(
        self,
        policy: Policy,
        tokenizer: Any,
        task: Task,
        samples: list[TaskSample],
        max_new_tokens: int,
        batch_size: int,
    ) -> None:
        from ais_lightning.rollout import SamplingConfig

        if not samples:
            raise ValueError("GreedyAccuracy needs at least one held-out sample")
        self.policy, self.tokenizer, self.task, self.batch_size = policy, tokenizer, task, batch_size
        self.samples = samples
        self.prompt_ids = encode_prompts(tokenizer, [s.prompt for s in samples], policy.chat_template)
        self.engine = policy.build_engine("fp32")
        self.sampling = SamplingConfig(
            n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id]
        )

    @torch.no_grad()
    def __call__(self) -> float:
        self.engine.sync_weights(self.policy.full_state_dict())
        correct = 0
        for start in range(0, len(self.samples), self.batch_size):
            chunk = self.samples[start : start + self.batch_size]
            out = self.engine.generate(self.prompt_ids[start : start + self.batch_size], self.sampling)
            rewards, _ = batch_rewards(self.task, chunk, out, self.tokenizer)
            correct += sum(r >= SOLVED_REWARD for r in rewards)
        return correct / len(self.samples)
