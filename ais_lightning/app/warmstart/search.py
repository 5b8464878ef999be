"""The band search: SFT in segments until the greedy accuracy lies in the target band, backing off on a jump.

See :mod:`ais_lightning.app.warmstart` for the procedure and why it stops on a band rather than a step count.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ais_lightning.app.warmstart.evaluate import GreedyAccuracy
from ais_lightning.app.warmstart.settings import WarmStartSettings
from ais_lightning.modules.sft import SFTModule, warmup_factor
from ais_lightning.policy import Policy
from ais_lightning.tasks import PromptDataModule, Task

__all__ = ["WarmStartError", "train_warm_start"]

log = logging.getLogger(__name__)


class WarmStartError(RuntimeError):
    """The SFT could not bring the greedy accuracy into the target band; ``history`` lists every evaluation."""

    def __init__(self, message: str, history: list[dict[str, float]] | None = None) -> None:
        super().__init__(message)
        self.history = list(history or [])


@dataclass
class _Snapshot:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


def _format_history(history: list[dict[str, float]], limit: int = 16) -> str:
    shown = history if len(history) <= limit else history[: limit // 2] + history[-limit // 2 :]
    parts = [f"step {int(h['step'])}: {h['accuracy']:.3f}" for h in shown]
    if len(shown) < len(history):
        parts.insert(limit // 2, "...")
    return ", ".join(parts)


def train_warm_start(
    policy: Policy,
    tokenizer: Any,
    task: Task,
    settings: WarmStartSettings,
    seed: int,
    progress_bar: bool = True,
) -> dict[str, Any]:
    """SFT ``policy`` in place with the band-stop procedure of the module docstring; no cache, no threads.

    Returns ``{"accuracy", "steps", "steps_trained", "backoffs", "lr", "history"}``; raises
    :class:`WarmStartError` when the band is not reached. Runs with the caller's thread setting (see
    :func:`warm_start` for the fixed one) and leaves the global RNG untouched.
    """
    from tqdm import tqdm

    module = SFTModule(
        policy,
        tokenizer,
        lr=settings.lr,
        warmup_steps=settings.warmup_steps,
        weight_decay=settings.weight_decay,
        grad_clip=settings.grad_clip,
    )
    data = PromptDataModule(
        task, train_size=None, val_size=settings.eval_size, batch_size=settings.batch_size, seed=seed
    )
    held_out = data.val_samples()  # the train stream redraws any prompt that is one of these
    stream = data.train_stream()
    evaluate = GreedyAccuracy(policy, tokenizer, task, held_out, settings.max_new_tokens, settings.batch_size)
    optimizer = module.build_optimizer()
    band = settings.target_band
    per_epoch = stream.batches_per_epoch
    history: list[dict[str, float]] = []
    lr, interval, step, trained, backoffs = settings.lr, settings.eval_every, 0, 0, 0

    def record(accuracy: float) -> None:
        history.append({"step": step, "steps_trained": trained, "accuracy": accuracy, "lr": lr})
        bar.set_postfix(step=step, acc=f"{accuracy:.3f}", lr=f"{lr:.2g}")

    def train(n: int) -> None:
        nonlocal step, trained
        for _ in range(n):
            batch = stream.batch(step // per_epoch, step % per_epoch)  # batch k of the trajectory
            module.train_step(optimizer, batch, lr * warmup_factor(step, settings.warmup_steps))
            step, trained = step + 1, trained + 1
            bar.update(1)

    def outcome(accuracy: float) -> dict[str, Any]:
        return {
            "accuracy": accuracy,
            "steps": step,
            "steps_trained": trained,
            "backoffs": backoffs,
            "lr": lr,
            "history": history,
        }

    was_training = policy.training
    policy.train()
    bar = tqdm(total=settings.steps, desc="warm start", disable=not progress_bar, leave=False)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if band is None:
                train(settings.steps)
                accuracy = evaluate()
                record(accuracy)
                return outcome(accuracy)
            low, high = band
            accuracy = evaluate()
            record(accuracy)
            if accuracy > high:
                raise WarmStartError(
                    f"the policy's greedy accuracy is {accuracy:.3f} before any SFT, above target_band "
                    f"[{low}, {high}]; SFT only raises it: raise warmstart.target_band or disable the warm start",
                    history,
                )
            snapshot = _Snapshot(0, copy.deepcopy(policy.state_dict()), copy.deepcopy(optimizer.state_dict()))
            while not low <= accuracy <= high:
                if trained >= settings.steps:
                    raise WarmStartError(
                        f"the warm start did not reach target_band [{low}, {high}] within steps={settings.steps} "
                        f"optimizer steps ({backoffs} back-off(s), best greedy accuracy "
                        f"{max(h['accuracy'] for h in history):.3f}; on {settings.eval_size} held-out prompts: "
                        f"{_format_history(history)}). Raise warmstart.steps or warmstart.lr, or lower "
                        "warmstart.target_band.",
                        history,
                    )
                previous = accuracy
                train(min(interval, settings.steps - trained))
                accuracy = evaluate()
                record(accuracy)
                if accuracy > high:
                    if backoffs >= settings.max_backoffs:
                        raise WarmStartError(
                            f"the warm start jumped over target_band [{low}, {high}] {backoffs + 1} times, last "
                            f"from {previous:.3f} to {accuracy:.3f} within {interval} steps at lr "
                            f"{lr:.3g} (greedy accuracy on {settings.eval_size} held-out prompts: "
                            f"{_format_history(history)}). Lower warmstart.eval_every or warmstart.lr, raise "
                            "warmstart.max_backoffs, or widen warmstart.target_band.",
                            history,
                        )
                    backoffs += 1
                    log.info(
                        "warm start: accuracy %.3f -> %.3f jumped over [%s, %s]; back to step %d with lr %.3g",
                        previous, accuracy, low, high, snapshot.step, lr * settings.backoff_factor,
                    )  # fmt: skip
                    policy.load_state_dict(snapshot.model)
                    optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer))
                    step, lr = snapshot.step, lr * settings.backoff_factor
                    interval = max(1, round(interval * settings.backoff_factor))
                    accuracy = previous
                elif accuracy < low:
                    snapshot = _Snapshot(
                        step, copy.deepcopy(policy.state_dict()), copy.deepcopy(optimizer.state_dict())
                    )
            return outcome(accuracy)
    finally:
        bar.close()
        policy.train(was_training)
        optimizer.zero_grad(set_to_none=True)
