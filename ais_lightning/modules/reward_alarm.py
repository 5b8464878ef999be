"""The constant-reward alarm: GRPO learns nothing while every sample of a step gets the same reward.

GRPO's advantages are relative to the group, so they are all zero when every reward of a group is equal; a run
whose rewards never vary (the policy does not answer in the task's format, a reward that never fires) trains on
nothing. ``GRPOModule`` feeds :class:`ConstantRewardAlarm` the smallest and largest reward of each step (over every
rank) and logs :func:`constant_reward_warning` once when the alarm fires.
"""

from __future__ import annotations

from typing import Any


class ConstantRewardAlarm:
    """Counts the consecutive rollout steps whose samples all got one reward (the same value each step).

    ``state`` (kept in checkpoints): ``streak`` (such steps in a row), ``value`` (their reward), ``first_step`` (the
    first of them) and ``warned`` (the alarm fired once already; it fires once per run).

    Example:
        >>> from ais_lightning.modules.reward_alarm import ConstantRewardAlarm
        >>> alarm = ConstantRewardAlarm(limit=2)
        >>> [alarm.observe(0.0, 0.0, step) for step in range(3)]  # fires at the second such step, once
        [False, True, False]
        >>> alarm.state["streak"], alarm.state["first_step"]
        (3, 0)
    """

    def __init__(self, limit: int, tol: float = 1e-6) -> None:
        self.limit, self.tol = limit, tol
        self.state: dict[str, Any] = {"streak": 0, "value": None, "first_step": 0, "warned": False}

    def observe(self, low: float, high: float, step: int) -> bool:
        """One step's reward range; True when the alarm fires now (``limit`` such steps in a row; 0 = never)."""
        state = self.state
        if high - low > self.tol:
            state.update(streak=0, value=None)
            return False
        if state["streak"] and state["value"] is not None and abs(state["value"] - low) <= self.tol:
            state["streak"] += 1
        else:
            state.update(streak=1, value=low, first_step=step)
        if not self.limit or state["warned"] or state["streak"] < self.limit:
            return False
        state["warned"] = True
        return True


def constant_reward_warning(
    task: str, state: dict[str, Any], step: int, example: tuple[str, str, str], scored: bool
) -> str:
    """The alarm's message: the task, the reward, the steps, a sample ``(prompt, completion, solution)`` and what to
    check; ``scored``: some greedy validation answer scored (so the policy can answer in the task's format)."""
    prompt, completion, solution = example
    low = state["value"]
    fired = "0 (the reward never fired)" if abs(low) <= 1e-6 else f"{low:g}"
    advice = (
        "Greedy validation answers did score, so the policy can answer in the task's format: sample more "
        "per step (algorithm.group_size, algorithm.prompts_per_step) or warm-start the policy"
        if scored
        else "If the policy cannot answer in the task's format, check task.format (chat for an "
        "instruction-tuned model prompted with policy.chat_template=true), task.extract (how the answer "
        "is read), algorithm.max_new_tokens, or warm-start the policy"
    )
    return (
        f"task {task!r}: the reward was {fired} on every sample of {state['streak']} consecutive rollout steps "
        f"(steps {state['first_step']}-{step}). GRPO's advantages are zero when every reward of a group is the same, "
        f"so these steps learned nothing. A sample: prompt {_clip(prompt)} -> completion {_clip(completion)}; "
        f"reference solution {_clip(solution)}. {advice} (algorithm.constant_reward_steps sets this check; 0 turns "
        "it off)."
    )


def first_example(batch: Any, prompts_batch: dict[str, list], tokenizer: Any) -> tuple[str, str, str]:
    """``(prompt, completion, solution)`` of a rollout ``batch``'s first row, for the alarm's message; ``prompts_batch``
    is the step's collated prompts (``"prompt"``, ``"solution"``)."""
    row = int(batch.prompt_index[0])
    completion = tokenizer.decode(
        batch.response_ids[0][batch.response_mask[0]].tolist(), skip_special_tokens=True
    )
    solution = prompts_batch.get("solution", ["?"] * (row + 1))[row]
    return prompts_batch["prompt"][row], completion, solution


def _clip(text: str, limit: int = 160) -> str:
    """``repr`` of ``text``, cut to ``limit`` characters (for log messages)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
