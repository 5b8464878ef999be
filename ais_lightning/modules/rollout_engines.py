"""The engines of a GRPO run: the rollout engine, the trainer-precision engine that validation samples with, and the
rollout source around them; built once per run from their factories, released at its end."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig
from ais_lightning.rollout.factory import same_engine
from ais_lightning.rollout.sources import InlineSource, NamedTensors, RolloutSource

log = logging.getLogger(__name__)

EngineFactory = Callable[[nn.Module], RolloutEngine]
"""Builds an engine from an unsharded copy of the policy's model."""


class RolloutEngines:
    """The rollout engine (``engine``), the trainer-precision engine (``eval_engine``, None without its factory) and
    the rollout source (``source``) of one GRPO module.

    Engines built earlier in the process (by a validation before ``fit``) are given new weights instead of being
    built again; when the trainer-precision engine would be built exactly as the rollout engine (an fp32 rollout),
    the rollout engine serves both: one copy of the model, not two.
    """

    def __init__(self, engine_factory: EngineFactory, eval_engine_factory: EngineFactory | None) -> None:
        self.engine_factory, self.eval_engine_factory = engine_factory, eval_engine_factory
        self.engine: RolloutEngine | None = None
        self.eval_engine: RolloutEngine | None = None
        self.source: RolloutSource | None = None
        self.calibration: Any = None
        """A checkpoint's engine calibration, until the engine takes it (:meth:`restore_calibration`)."""

    def build_or_sync(
        self, build: Callable[[EngineFactory, NamedTensors], RolloutEngine], state: NamedTensors
    ) -> None:
        """Build the engines (``build(factory, state)``, e.g. :func:`build_engine` on a fresh model) with the weights
        ``state``, or give the built ones ``state``."""
        if self.engine is None:
            self.engine = build(self.engine_factory, state)
        else:
            self.engine.sync_weights(state)
        if self.eval_engine_factory is None:
            return
        if same_engine(self.eval_engine_factory, self.engine_factory):
            self.eval_engine = self.engine
        elif self.eval_engine is None:
            self.eval_engine = build(self.eval_engine_factory, state)
        else:
            self.eval_engine.sync_weights(state)

    def start_source(
        self,
        version: int,
        state: NamedTensors,
        settings: Any,
        staleness: Any,
        workers: Any,
        seed: int,
        fresh_model: Callable[[], nn.Module],
    ) -> None:
        """The rollout source, once, its engine holding ``version``'s weights (``state``, just given to it): the
        ``workers``' (``RayWorkers.build_source``, each worker building its engine on a ``fresh_model()``), else the in-process one (:class:`InlineSource`: synchronous
        without ``staleness``, else the deterministic lag of ``settings``, a ``GRPOSettings``)."""
        if self.source is None and workers is not None:
            assert self.engine is not None and staleness is not None, (
                "rollout workers need the asynchronous mode"
            )
            self.source = workers.build_source(
                engine=self.engine,
                engine_factory=self.engine_factory,
                model=fresh_model(),
                version=version,
                named_tensors=state,
                bound=staleness.bound,
                on_stale=settings.on_stale,
            )
        elif self.source is None:
            assert self.engine is not None
            self.source = InlineSource(
                self.engine,
                staleness.snapshots if staleness is not None else None,
                lag=settings.lag,
                bound=staleness.bound if staleness is not None else 0,
                on_stale=settings.on_stale,
                randomized=settings.rollout_lag_random,
                seed=seed,
            )
        elif self.source.version != version:  # started at another step (a validation before a resumed fit)
            self.source.publish(version, state)
        self.source.engine_version = version

    def hold_current(self, version: int, weights: Callable[[], NamedTensors]) -> None:
        """Before a validation: both engines hold ``version``'s weights (``weights()`` gathered once if needed)."""
        assert self.source is not None, "the rollout source starts with the engines"
        self.source.hold(version, weights)
        if self.eval_engine is not None and self.eval_engine is not self.engine:
            self.eval_engine.sync_weights(weights())

    def restore_calibration(self) -> None:
        """A resumed run's engine takes the checkpoint's calibration (outlier channels, ranges seen since the last
        sync), so it quantizes as the uninterrupted run would; once, after the engine is built."""
        state, self.calibration = self.calibration, None
        if state is None or self.engine is None:
            return
        try:
            self.engine.load_calibration_state(state)
        except ValueError as err:
            log.warning("the checkpoint's engine calibration does not fit the engine, recalibrating: %s", err)

    def close(self) -> None:
        """Release the source (its workers) and each distinct engine (``close``: a vLLM engine's device memory)."""
        source, self.source = self.source, None
        engines = {id(e): e for e in (self.engine, self.eval_engine) if e is not None}
        self.engine = self.eval_engine = None
        try:
            if source is not None:
                source.close()
        finally:
            for engine in engines.values():
                engine.close()


def build_engine(
    factory: EngineFactory, fresh_model: Callable[[], nn.Module], state: NamedTensors
) -> RolloutEngine:
    """``factory(fresh_model())`` with the weights ``state``; TypeError when the factory builds no rollout engine."""
    # Outside inference mode even when a validation builds it (Lightning validates under inference mode): the engine
    # outlives that validation, and later syncs write its weights in place.
    with torch.inference_mode(False):
        engine = factory(fresh_model())
        if not isinstance(engine, RolloutEngine):
            raise TypeError(
                f"the engine factory built a {type(engine).__name__}, not a rollout engine (a subclass of "
                "ais_lightning.rollout.RolloutEngine)"
            )
        engine.sync_weights(state)
    return engine


def generate_outside_training(
    engine: RolloutEngine, prompt_ids: list[list[int]], sampling: SamplingConfig
) -> RolloutBatch:
    """``engine.generate`` for validation or a check, leaving the engine's calibration (outlier channels, ranges seen
    since the last sync) as it was: a run trains the same whether and how often it validates, and a resumed run as
    the uninterrupted one."""
    state = engine.calibration_state()
    try:
        return engine.generate(prompt_ids, sampling)
    finally:
        if state is not None:
            engine.load_calibration_state(state)
