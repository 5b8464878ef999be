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
    was_training = policy.training
    policy.train()
    bar = tqdm(total=settings.steps, desc="warm start", disable=not progress_bar, leave=False)
    search = _BandSearch(module, optimizer, stream, evaluate, settings, bar)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return search.run()
    finally:
        bar.close()
        policy.train(was_training)
        optimizer.zero_grad(set_to_none=True)


class _BandSearch:
    """One warm start's SFT: its position on the data trajectory (``step``, which a back-off rewinds), the steps
    trained (back-offs included: the budget), the learning rate, the interval between evaluations, the back-offs
    and every evaluation (``history``)."""

    def __init__(
        self,
        module: SFTModule,
        optimizer: torch.optim.Optimizer,
        stream: Any,
        evaluate: GreedyAccuracy,
        settings: WarmStartSettings,
        bar: Any,
    ) -> None:
        self.module, self.optimizer, self.stream, self._evaluate = module, optimizer, stream, evaluate
        self.settings, self.bar = settings, bar
        self.history: list[dict[str, float]] = []
        self.lr, self.interval, self.step, self.trained, self.backoffs = (
            settings.lr,
            settings.eval_every,
            0,
            0,
            0,
        )

    def run(self) -> dict[str, Any]:
        """Train ``steps`` steps (no band), or until the greedy accuracy lies in the band (module docstring)."""
        settings = self.settings
        if settings.target_band is None:
            self.train(settings.steps)
            return self.outcome(self.evaluate())
        low, high = settings.target_band
        accuracy = self.evaluate()
        if accuracy > high:
            raise WarmStartError(
                f"the policy's greedy accuracy is {accuracy:.3f} before any SFT, above target_band "
                f"[{low}, {high}]; SFT only raises it: raise warmstart.target_band or disable the warm start",
                self.history,
            )
        snapshot = self.snapshot()
        while not low <= accuracy <= high:
            if self.trained >= settings.steps:
                raise WarmStartError(
                    f"the warm start did not reach target_band [{low}, {high}] within steps={settings.steps} "
                    f"optimizer steps ({self.backoffs} back-off(s), best greedy accuracy "
                    f"{max(h['accuracy'] for h in self.history):.3f}; on {settings.eval_size} held-out prompts: "
                    f"{_format_history(self.history)}). Raise warmstart.steps or warmstart.lr, or lower "
                    "warmstart.target_band.",
                    self.history,
                )
            previous = accuracy
            self.train(min(self.interval, settings.steps - self.trained))
            accuracy = self.evaluate()
            if accuracy > high:
                self.back_off(snapshot, previous, accuracy)
                accuracy = previous
            elif accuracy < low:
                snapshot = self.snapshot()
        return self.outcome(accuracy)

    def train(self, n: int) -> None:
        """``n`` optimizer steps on the next batches of the trajectory (batch k is the same in every run)."""
        per_epoch = self.stream.batches_per_epoch
        for _ in range(n):
            batch = self.stream.batch(
                self.step // per_epoch, self.step % per_epoch
            )  # batch k of the trajectory
            lr = self.lr * warmup_factor(self.step, self.settings.warmup_steps)
            self.module.train_step(self.optimizer, batch, lr)
            self.step, self.trained = self.step + 1, self.trained + 1
            self.bar.update(1)

    def evaluate(self) -> float:
        """The greedy accuracy on the held-out prompts, recorded in ``history``."""
        accuracy = self._evaluate()
        self.history.append(
            {"step": self.step, "steps_trained": self.trained, "accuracy": accuracy, "lr": self.lr}
        )
        self.bar.set_postfix(step=self.step, acc=f"{accuracy:.3f}", lr=f"{self.lr:.2g}")
        return accuracy

    def snapshot(self) -> _Snapshot:
        """The policy and optimizer now, to back off to."""
        policy = self.module.policy
        return _Snapshot(
            self.step, copy.deepcopy(policy.state_dict()), copy.deepcopy(self.optimizer.state_dict())
        )

    def back_off(self, snapshot: _Snapshot, previous: float, accuracy: float) -> None:
        """The accuracy jumped over the band: back to ``snapshot`` with a smaller learning rate and interval, or
        WarmStartError after ``max_backoffs`` back-offs."""
        settings = self.settings
        low, high = settings.target_band
        if self.backoffs >= settings.max_backoffs:
            raise WarmStartError(
                f"the warm start jumped over target_band [{low}, {high}] {self.backoffs + 1} times, last "
                f"from {previous:.3f} to {accuracy:.3f} within {self.interval} steps at lr "
                f"{self.lr:.3g} (greedy accuracy on {settings.eval_size} held-out prompts: "
                f"{_format_history(self.history)}). Lower warmstart.eval_every or warmstart.lr, raise "
                "warmstart.max_backoffs, or widen warmstart.target_band.",
                self.history,
            )
        self.backoffs += 1
        log.info(
            "warm start: accuracy %.3f -> %.3f jumped over [%s, %s]; back to step %d with lr %.3g",
            previous, accuracy, low, high, snapshot.step, self.lr * settings.backoff_factor,
        )  # fmt: skip
        self.module.policy.load_state_dict(snapshot.model)
        self.optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer))
        self.step, self.lr = snapshot.step, self.lr * settings.backoff_factor
        self.interval = max(1, round(self.interval * settings.backoff_factor))

    def outcome(self, accuracy: float) -> dict[str, Any]:
        """What :func:`train_warm_start` returns."""
        return {
            "accuracy": accuracy,
            "steps": self.step,
            "steps_trained": self.trained,
            "backoffs": self.backoffs,
            "lr": self.lr,
            "history": self.history,
        }
