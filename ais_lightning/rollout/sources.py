"""Rollout sources: where a GRPO step's rollouts come from, and from which policy version.

``GRPOModule`` asks its source for the rollouts of each step's prompts and publishes the new weights to it after
every update; the source decides which weights generate them. Two sources share that contract:

- :class:`InlineSource` (the default, one process): the rollout engine lives in the trainer's process. With
  ``max_staleness=0`` it is the synchronous loop (generate with the current weights, update, sync). Otherwise it is
  the *deterministic* asynchronous mode: step ``s`` is generated with the weights of exactly ``lag`` versions ago,
  kept as snapshots (:class:`ais_lightning.staleness.WeightSnapshots`), so a run is reproducible and a staleness
  is controlled exactly, for tests and for controlled evidence.
- :class:`ais_lightning.rollout.ray_workers.RaySource`: rollout workers on Ray generate ahead while the trainer
  updates (generation overlaps training); the staleness is what the timing makes it, within the bound.

Both stamp every row with its generating version (:class:`VersionedRollouts`), so the
trainer's code is the same for both.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig
from ais_lightning.staleness.snapshots import WeightSnapshots
from ais_lightning.staleness.versions import generating_version, lag_at

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass
class VersionedRollouts:
    """A rollout batch whose rows carry the policy version of the weights that generated them."""

    batch: RolloutBatch
    versions: torch.Tensor
    """``[B]`` long: the policy version that generated each row."""
    dropped: int = 0
    """Rows generated (or due) for this batch and discarded as staler than the bound (``on_stale="drop"``)."""

    def __post_init__(self) -> None:
        rows = self.batch.response_ids.shape[0]
        if self.versions.shape != (rows,) or self.versions.dtype != torch.long:
            raise ValueError(
                f"versions must be a [B] long tensor with B = {rows} rows, got {tuple(self.versions.shape)} "
                f"{self.versions.dtype}"
            )

    def staleness(self, current: int) -> torch.Tensor:
        """``current - version`` per row (``[B]`` long), ``current`` being the version trained now."""
        return current - self.versions


@dataclass
class RolloutRequest:
    """What to generate for one rollout step: token-id prompts and how to sample them (seeded per step)."""

    prompt_ids: list[list[int]]
    sampling: SamplingConfig


class RolloutSource(abc.ABC):
    """The contract between the GRPO loop and whatever generates its rollouts.

    Per rollout step ``s`` (the trained weights are version ``s``) the loop calls :meth:`rollouts` with the step's
    request, then updates, then :meth:`publish` es version ``s + 1``. A source that generates ahead gets the
    requests of the next :meth:`lookahead` steps through :meth:`submit` first. The in-process ``engine`` (the one
    validation also samples with) holds the weights of :attr:`engine_version`; :meth:`hold` brings it to a version.
    """

    HISTORY_STATS: ClassVar[dict[str, str]] = {}
    """What each entry of the run's history (the end-of-run summary) records of :meth:`stats`: name -> key."""

    def __init__(self, engine: RolloutEngine, engine_version: int = 0) -> None:
        self.engine = engine
        self.engine_version = engine_version
        """The policy version of the in-process engine's weights."""
        self.version = engine_version
        """The newest policy version published to the source."""

    @abc.abstractmethod
    def rollouts(self, step: int, request: RolloutRequest, version: int) -> VersionedRollouts:
        """The rollouts of step ``step``'s ``request``, trained at policy version ``version``."""

    def publish(self, version: int, named_tensors: NamedTensors) -> None:
        """The trainer's weights after an update, as policy version ``version`` (:meth:`deliver` them)."""
        self.version = version
        self.deliver(version, named_tensors)

    @abc.abstractmethod
    def deliver(self, version: int, named_tensors: NamedTensors) -> None:
        """Hand policy version ``version``'s weights to whatever generates (the engine, the workers)."""

    def lookahead(self) -> int:
        """How many future steps' requests the source wants now (``submit``); 0: none (it generates on demand)."""
        return 0

    def submit(self, step: int, request: RolloutRequest) -> None:  # noqa: B027 - optional
        """The request of a future step ``step`` (for a source that generates ahead). Default: ignored."""

    def hold(self, version: int, named_tensors: Callable[[], NamedTensors]) -> None:
        """Make the in-process engine hold ``version``'s weights (``named_tensors()`` gives them when it does not)."""
        if self.engine_version != version:
            self.engine.sync_weights(named_tensors())
            self.engine_version = version

    def stats(self) -> dict[str, float]:
        """What the source logs for the last step (queue depth, idle time, ...); empty by default."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 - optional
        pass

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release what the source holds beyond the in-process engine (workers, a cluster)."""


class InlineSource(RolloutSource):
    """The rollout engine in the trainer's process: the synchronous loop, or a deterministic lag.

    Args:
        engine: the rollout engine, holding the weights of ``engine_version``.
        snapshots: the trainer's weights of the last versions (None: the synchronous loop, ``publish`` syncs the
            engine at once, as the loop always did).
        lag: versions between the generating weights and the trained ones, cycled over steps (``randomized``:
            drawn uniformly, seeded by ``(seed, step)``); default ``[0]``.
        bound: the staleness bound, a number or a callable returning the current one (an adaptive bound); a lag
            beyond it is handled by ``on_stale`` (``ais_lightning.staleness.generating_version``).
        on_stale: ``"wait"`` or ``"drop"``.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        snapshots: WeightSnapshots | None = None,
        lag: Sequence[int] = (0,),
        bound: int | Callable[[], int] = 0,
        on_stale: str = "wait",
        randomized: bool = False,
        seed: int = 0,
        engine_version: int = 0,
    ) -> None:
        super().__init__(engine, engine_version)
        if snapshots is None and any(lag):
            raise ValueError(f"a lag of {list(lag)} needs the snapshots of the versions it generates with")
        self.snapshots, self.lag, self.on_stale = snapshots, list(lag), on_stale
        self.bound = bound if callable(bound) else (lambda: int(bound))
        self.randomized, self.seed = randomized, seed

    def rollouts(self, step: int, request: RolloutRequest, version: int) -> VersionedRollouts:
        lag = lag_at(step, self.lag, self.randomized, self.seed)
        generating, dropped = generating_version(version, lag, self.bound(), self.on_stale)
        if self.snapshots is not None and generating != self.engine_version:
            self.engine.sync_weights(self.snapshots.get(generating))
            self.engine_version = generating
        batch = self.engine.generate(request.prompt_ids, request.sampling)
        rows = batch.response_ids.shape[0]
        versions = torch.full((rows,), generating, dtype=torch.long)
        return VersionedRollouts(batch, versions, dropped=rows if dropped else 0)

    def deliver(self, version: int, named_tensors: NamedTensors) -> None:
        if self.snapshots is None:  # the synchronous loop: the engine follows the trainer at once
            self.engine.sync_weights(named_tensors)
            self.engine_version = version
