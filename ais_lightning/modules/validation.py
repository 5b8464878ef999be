"""GRPO's validation: greedy accuracy with the engine's precision and with the trainer's, over every rank, and one
example each time (:class:`GRPOValidation`, a part of ``GRPOModule``; :class:`ValidationTally`, its record)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ais_lightning import ops
from ais_lightning.modules.rollout_engines import generate_outside_training
from ais_lightning.rollout.base import RolloutBatch, SamplingConfig
from ais_lightning.tasks import SOLVED_REWARD, task_fields


class ValidationTally:
    """Per validation: the solved and scored prompts per engine name (``"engine"``, ``"trainer"``) and the first
    prompt's example; :meth:`finish` sums them over ranks and appends the validation to :attr:`history`.

    Example:
        >>> import torch
        >>> from ais_lightning.modules.validation import ValidationTally
        >>> tally = ValidationTally()
        >>> tally.start()
        >>> tally.add("engine", 3.0, 4.0)
        >>> tally.example("1+2=", "3", "3")
        >>> tally.finish(step=5, names=["engine"], device="cpu", reduce=lambda t, reduce_op: t)
        >>> tally.history
        [{'step': 5, 'accuracy': {'val/accuracy_engine': 0.75}, 'example': {'prompt': '1+2=', 'completion': '3', 'solution': '3'}}]
    """

    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []
        """Every validation: ``{"step", "accuracy": {"val/accuracy_<engine>": float}, "example": {"prompt",
        "completion", "solution"}}`` (kept in checkpoints; the end-of-run summary reads it)."""
        self._tally: dict[str, list[float]] = {}
        self._example: dict[str, str] | None = None

    def start(self) -> None:
        """A new validation begins."""
        self._tally, self._example = {}, None

    def add(self, name: str, solved: float, scored: float) -> None:
        """One batch of engine ``name``: ``solved`` of ``scored`` prompts."""
        tally = self._tally.setdefault(name, [0.0, 0.0])
        tally[0] += solved
        tally[1] += scored

    @property
    def needs_example(self) -> bool:
        """Whether this validation has no example yet."""
        return self._example is None

    def example(self, prompt: str, completion: str, solution: str) -> None:
        """The validation's example (the first one given is kept)."""
        if self._example is None:
            self._example = {"prompt": prompt, "completion": completion, "solution": solution}

    def finish(self, step: int, names: list[str], device: Any, reduce: Callable[..., torch.Tensor]) -> None:
        """Sum the tallies of ``names`` over ranks (``reduce``: the strategy's, a collective: every rank calls it) and
        record the accuracies at rollout step ``step``; nothing when no prompt was scored."""
        if not names:
            return
        tallies = [self._tally.get(n, [0.0, 0.0]) for n in names]  # the same shape on every rank
        local = torch.tensor(tallies, dtype=torch.float64, device=device)
        total = reduce(local, reduce_op="sum").tolist()  # per engine: solved, scored
        if not any(k for _, k in total):
            return
        accuracy = {f"val/accuracy_{n}": float(c / max(k, 1.0)) for n, (c, k) in zip(names, total)}
        self.history.append({"step": step, "accuracy": accuracy, "example": dict(self._example or {})})


class GRPOValidation:
    """The validation hooks of ``GRPOModule`` (kept in this file so that the module's file shows the loop): before a
    validation both engines get the current weights; each batch is answered greedily by the engine (its precision)
    and by the trainer-precision engine; ``val/accuracy_engine`` / ``val/accuracy_trainer`` are logged and recorded
    in :attr:`validation_history`."""

    # Read from the module: engines, validation (a ValidationTally), rollout_step, sampling, tokenizer, device,
    # encode_prompts(), score(), on_train_start(), apply_precision_schedule(), _full_state(); from Lightning: log(),
    # trainer.

    @property
    def validation_history(self) -> list[dict[str, Any]]:
        """Every validation (kept in checkpoints): ``{"step", "accuracy": {"val/accuracy_<engine>": float},
        "example": {"prompt", "completion", "solution"}}``; the summary reads it."""
        return self.validation.history

    @validation_history.setter
    def validation_history(self, value: list[dict[str, Any]]) -> None:
        self.validation.history = list(value)

    def on_validation_start(self) -> None:
        if self.engine is None:  # validation before training (sanity check) or trainer.validate
            self.on_train_start()
        else:  # the engine-precision accuracy is the current weights', whatever the rollouts were generated with
            self.engines.hold_current(self.rollout_step, functools.cache(self._full_state))
        # progressive precision: validate in the stage of the last step trained (the next step switches on)
        self.apply_precision_schedule(max(self.rollout_step - 1, 0))

    def on_validation_epoch_start(self) -> None:
        self.validation.start()

    def on_validation_epoch_end(self) -> None:
        """Record this validation's accuracy per engine (over every rank) and its example in
        ``validation_history`` (not for Lightning's sanity check)."""
        if self.trainer.sanity_checking:
            return
        names = [n for n, e in (("engine", self.engine), ("trainer", self.eval_engine)) if e is not None]
        self.validation.finish(self.rollout_step, names, self.device, self.trainer.strategy.reduce)

    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        """Greedy accuracy with the engine's precision and with the trainer's precision."""
        prompts = batch["prompt"]
        greedy = SamplingConfig(
            n=1,
            temperature=0.0,
            max_new_tokens=self.sampling.max_new_tokens,
            stop_token_ids=self.sampling.stop_token_ids,
        )
        done: dict[int, tuple[RolloutBatch, torch.Tensor]] = {}  # an engine serving both names runs once
        for name, engine in (("engine", self.engine), ("trainer", self.eval_engine)):
            if engine is None:
                continue
            if id(engine) not in done:
                out = generate_outside_training(engine, self.encode_prompts(prompts), greedy)
                out = ops.to_device(out, self.device)
                done[id(engine)] = out, self.score(out, prompts, task_fields(batch))[0]
            out, rewards = done[id(engine)]
            solved = rewards >= SOLVED_REWARD
            self.validation.add(name, float(solved.sum()), float(rewards.numel()))
            if name == "engine" and self.validation.needs_example:
                row = int(out.prompt_index[0])
                response = out.response_ids[0][out.response_mask[0]].tolist()
                completion = self.tokenizer.decode(response, skip_special_tokens=True)
                solution = batch["solution"][row] if "solution" in batch else ""
                self.validation.example(prompts[row], completion, solution)
            self.log(f"val/reward_{name}", rewards.mean(), batch_size=len(prompts), sync_dist=True)
            self.log(f"val/accuracy_{name}", solved.float().mean(), batch_size=len(prompts), sync_dist=True)
