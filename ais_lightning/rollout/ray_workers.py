"""Disaggregated rollout workers on Ray: generation overlaps the trainer's update.

``workers=ray`` (``ais-train``) or ``GRPOModule(..., workers=RayWorkers(...))``: ``num_workers`` Ray actors, each
holding one rollout engine built from the run's engine factory (the torch engine on CPU, any engine on a GPU node),
generate the requests of the next steps while the Lightning trainer (same module, same strategies) updates. Each
step's prompts are split into one chunk per worker; every chunk comes back stamped with the policy version its
worker held when it started it. After every update the trainer publishes the new weights once to Ray's object
store (one ``ray.put``, N gets); a worker receives them in its own thread, so a weight transfer never waits behind a
generation, and applies the newest weights it holds before each chunk (an int8 or fp8 engine requantizes then). A chunk
requested after a publish is generated with those weights or newer: it carries the version published last, and its
worker waits for that version's weights if they are still on their way.

Staleness (:mod:`ais_lightning.staleness`): with ``on_stale="wait"`` the trainer requests at most ``bound`` steps
ahead, so no chunk can be staler than the bound (generation waits for the trainer); with ``"drop"`` it requests
further ahead (``lookahead``) and a chunk staler than the bound when its step is trained is discarded, counted and
generated again with the newest weights.

Failures: a worker that dies (its process killed) is started again from the newest weights and its chunks requested
again, up to ``max_restarts`` times; past that, or a chunk that takes longer than ``timeout_s``, the run fails with
an error naming the worker (never a hang). :meth:`RaySource.close` kills the workers and shuts down a cluster it
started, however the run ends. The NCCL path for GPU workers is designed in docs/async.md.

Ray is an optional extra (``pip install 'ais-lightning[ray]'``; ``make install`` installs it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ais_lightning.checks import check_int
from ais_lightning.ops import pad_sequences
from ais_lightning.rollout.base import RolloutBatch, RolloutEngine, SamplingConfig
from ais_lightning.rollout.sources import NamedTensors, RolloutRequest, RolloutSource, VersionedRollouts
from ais_lightning.rollout.support import SamplingSupport
from ais_lightning.staleness.versions import STALE_POLICIES

log = logging.getLogger(__name__)

MISSING_RAY = (
    "workers=ray needs Ray, an optional extra of ais-lightning: pip install 'ais-lightning[ray]' (or pip install "
    "'ray>=2.40'); make install installs it"
)


def import_ray() -> Any:
    """``ray``, or ImportError naming the extra that installs it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(MISSING_RAY) from err
    return ray


@dataclass
class RayWorkers:
    """Rollout workers on Ray (the ``workers=ray`` group of ``ais-train``); each default lives here only."""

    num_workers: int = 1
    """Ray actors, each holding one rollout engine."""
    num_cpus: float = 1.0
    """CPUs Ray reserves per worker (placement); the trainer's process is not a Ray task and takes none."""
    num_gpus: float = 0.0
    """GPUs Ray reserves per worker (a vLLM or GPU torch engine)."""
    threads: int | None = None
    """torch intra-op threads in each worker; None: ``num_cpus`` rounded (at least 1)."""
    address: str | None = None
    """The Ray cluster: None starts a local one (``ray.init()``, shut down at the end of the run); ``auto`` or
    ``host:port`` joins a running one (``ray start --head``; docs/cluster.md), left running."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per worker, e.g. ``{rollout: 1}`` to place the workers on nodes started with
    ``ray start --resources='{"rollout": 4}'``."""
    lookahead: int | None = None
    """Steps requested ahead of the one trained; None: the staleness bound with ``on_stale=wait`` (more could only be
    staler than the bound), twice the bound (at least one more) with ``drop``."""
    max_restarts: int = 1
    """Times each worker is started again after it died (0: the run fails at once, naming the worker)."""
    timeout_s: float = 600.0
    """A chunk of rollouts that does not arrive within this many seconds fails the run, naming its worker."""
    object_store_memory: int | None = None
    """Bytes of the object store of a local cluster (None: Ray's default); the weights are put there once per
    update."""

    def __post_init__(self) -> None:
        check_int(self.num_workers, "num_workers")
        check_int(self.max_restarts, "max_restarts", minimum=0)
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.threads is not None:
            check_int(self.threads, "threads")
        if self.lookahead is not None:
            check_int(self.lookahead, "lookahead", minimum=0)
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or self.timeout_s <= 0
        ):
            raise ValueError(f"timeout_s must be a number > 0, got {self.timeout_s!r}")
        if not all(isinstance(v, (int, float)) and v >= 0 for v in self.resources.values()):
            raise ValueError(
                f"resources must map resource names to numbers >= 0, got {dict(self.resources)!r}"
            )
        self.resources = dict(self.resources)

    @property
    def worker_threads(self) -> int:
        return self.threads if self.threads is not None else max(1, round(self.num_cpus))

    def build_source(
        self,
        engine: RolloutEngine,
        engine_factory: Any,
        model: torch.nn.Module,
        version: int,
        named_tensors: NamedTensors,
        bound: Any,
        on_stale: str = "wait",
    ) -> RaySource:
        """Start the workers (``engine_factory(model)`` in each, with ``version``'s weights); ``engine`` stays the
        trainer's in-process engine (validation samples with it)."""
        return RaySource(self, engine, engine_factory, model, version, named_tensors, bound, on_stale)


class RolloutWorker:
    """One Ray actor: a rollout engine, the newest weights it received, and its chunks of rollouts.

    ``generate`` runs in the actor's default thread; ``set_weights`` in the ``weights`` concurrency group, so a
    weight transfer lands while a chunk is being generated and is applied before the next one. Ray orders the calls
    of one concurrency group, not calls across groups: a ``generate`` sent after a ``set_weights`` may start first,
    so ``generate`` takes the lowest version it may use (``min_version``) and waits until it holds it.
    """

    def __init__(
        self, model: torch.nn.Module, engine_factory: Any, threads: int, version: int, weights: Any
    ) -> None:
        torch.set_num_threads(threads)
        self.engine = engine_factory(model)
        self.engine.sync_weights(weights)
        self.version = version
        self._pending: tuple[int, Any] | None = None
        self._received = threading.Condition()

    def set_weights(self, version: int, weights: Any) -> None:
        with self._received:
            if self._pending is None or version > self._pending[0]:
                self._pending = (version, weights)
            self._received.notify_all()

    def _newest_held(self) -> int:
        return max(self.version, -1 if self._pending is None else self._pending[0])

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, min_version: int = 0
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self._received:  # the trainer's timeout_s bounds this wait
            self._received.wait_for(lambda: self._newest_held() >= min_version)
            pending, self._pending = self._pending, None
        weights_wait_s = time.perf_counter() - t0
        sync_s = 0.0
        if pending is not None and pending[0] > self.version:
            t0 = time.perf_counter()
            self.engine.sync_weights(pending[1])
            self.version, sync_s = pending[0], time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = self.engine.generate(prompt_ids, sampling)
        return {
            "batch": batch,
            "version": self.version,
            "seconds": time.perf_counter() - t0,
            "sync_s": sync_s,
            "weights_wait_s": weights_wait_s,
        }

    def where(self) -> tuple[int, str]:
        """``(pid, Ray node id)`` of this worker."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()


@dataclass
class _Chunk:
    """One worker's part of a step's request, and the Ray reference of its result."""

    worker: int
    rows: list[int]  # which of the step's prompts
    request: RolloutRequest
    ref: Any = None


@dataclass
class _Step:
    request: RolloutRequest
    chunks: list[_Chunk]


class RaySource(RolloutSource):
    """Rollouts from workers on Ray (:class:`RayWorkers`); see the module docstring."""

    HISTORY_STATS: ClassVar[dict[str, str]] = {
        "rollout_wait_s": "async/idle_s",
        "worker_restarts": "async/restarts",
    }

    def __init__(
        self,
        settings: RayWorkers,
        engine: RolloutEngine,
        engine_factory: Any,
        model: torch.nn.Module,
        version: int,
        named_tensors: NamedTensors,
        bound: Any,
        on_stale: str = "wait",
    ) -> None:
        super().__init__(engine, version)
        if on_stale not in STALE_POLICIES:
            raise ValueError(f"on_stale must be one of {STALE_POLICIES}, got {on_stale!r}")
        self.ray = ray = import_ray()
        self.settings, self.on_stale = settings, on_stale
        self.bound = bound if callable(bound) else (lambda: int(bound))
        self.initialized_ray = not ray.is_initialized()
        if self.initialized_ray:
            keep = signal.getsignal(
                signal.SIGTERM
            )  # ray.init installs its own SIGTERM handler: the run's stays
            ray.init(
                address=settings.address,
                include_dashboard=False,
                log_to_driver=True,
                object_store_memory=settings.object_store_memory,
                configure_logging=False,
            )
            if keep is not None:
                signal.signal(signal.SIGTERM, keep)
        self.steps: dict[int, _Step] = {}
        self.restarts = [0] * settings.num_workers
        self.where: list[tuple[int, str]] = [(0, "")] * settings.num_workers
        self._timings: dict[str, float] = {}  # of the last step's rollouts
        self._publish_s: float | None = None  # of the last publish
        self._model_ref = ray.put(model)
        self._factory = engine_factory
        self._latest = (version, ray.put([(name, t.detach().cpu()) for name, t in named_tensors]))
        self.workers = [self._start_worker(i) for i in range(settings.num_workers)]

    # ------------------------------------------------------------ workers
    def _start_worker(self, index: int) -> Any:
        s = self.settings
        actor_class = self.ray.remote(concurrency_groups={"weights": 1})(RolloutWorker).options(
            num_cpus=s.num_cpus, num_gpus=s.num_gpus, resources=s.resources or None, max_restarts=0
        )
        version, weights = self._latest
        actor = actor_class.remote(self._model_ref, self._factory, s.worker_threads, version, weights)
        self.where[index] = self._get(actor.where.remote(), index, "to start")
        return actor

    def _name(self, index: int) -> str:
        pid, node = self.where[index]
        return f"rollout worker {index} (pid {pid}, node {node[:12]})"

    def _get(self, ref: Any, index: int, what: str) -> Any:
        """``ray.get`` of one worker's result within ``timeout_s``; RuntimeError naming the worker on a timeout."""
        try:
            return self.ray.get(ref, timeout=self.settings.timeout_s)
        except self.ray.exceptions.GetTimeoutError as err:
            raise RuntimeError(
                f"{self._name(index)} took longer than workers.timeout_s={self.settings.timeout_s} s {what}"
            ) from err

    def _restart(self, index: int, err: Exception) -> None:
        """Start worker ``index`` again from the newest weights and request its pending chunks again; RuntimeError
        naming it once it used up ``max_restarts``."""
        name = self._name(index)
        if self.restarts[index] >= self.settings.max_restarts:
            raise RuntimeError(
                f"{name} died and was restarted {self.restarts[index]} time(s) already (workers.max_restarts="
                f"{self.settings.max_restarts}): {type(err).__name__}: {err}"
            ) from err
        self.restarts[index] += 1
        log.warning("%s died (%s); starting it again from the newest weights", name, type(err).__name__)
        self.workers[index] = self._start_worker(index)
        for step in self.steps.values():
            for chunk in step.chunks:
                if chunk.worker == index:
                    self._send(chunk)

    # -------------------------------------------------------------- chunks
    def _send(self, chunk: _Chunk) -> None:
        chunk.ref = self.workers[chunk.worker].generate.remote(
            chunk.request.prompt_ids, chunk.request.sampling, self._latest[0]
        )  # with the weights published last or newer

    def _dispatch(self, step: int, request: RolloutRequest) -> _Step:
        """Split ``request`` into one chunk per worker (prompts dealt round robin) and send them."""
        n = len(self.workers)
        chunks = []
        for index in range(min(n, len(request.prompt_ids))):
            rows = list(range(index, len(request.prompt_ids), n))
            seed = request.sampling.seed
            sampling = dataclasses.replace(
                request.sampling, seed=None if seed is None else (seed + 7919 * index) % 2**31
            )
            chunk = _Chunk(index, rows, RolloutRequest([request.prompt_ids[r] for r in rows], sampling))
            self._send(chunk)
            chunks.append(chunk)
        return _Step(request, chunks)

    def lookahead(self) -> int:
        bound = self.bound()
        if self.settings.lookahead is not None:
            return self.settings.lookahead if self.on_stale == "drop" else min(self.settings.lookahead, bound)
        return bound if self.on_stale == "wait" else max(2 * bound, bound + 1)

    def submit(self, step: int, request: RolloutRequest) -> None:
        if step not in self.steps:
            self.steps[step] = self._dispatch(step, request)

    def rollouts(self, step: int, request: RolloutRequest, version: int) -> VersionedRollouts:
        t0 = time.perf_counter()
        ready_before = self._ready_steps()
        pending = self.steps.get(step)
        if pending is None or pending.request != request:  # not requested ahead, or for other prompts
            if pending is not None:
                log.warning("the prompts of step %d differ from those requested ahead: requested again", step)
            self.steps[step] = pending = self._dispatch(step, request)
        bound, dropped = self.bound(), 0
        results: dict[int, dict[str, Any]] = {}
        while len(results) < len(pending.chunks):
            for chunk in pending.chunks:
                if chunk.worker in results:
                    continue
                try:
                    result = self._get(chunk.ref, chunk.worker, f"to generate its rollouts of step {step}")
                except self.ray.exceptions.RayActorError as err:
                    self._restart(chunk.worker, err)
                    continue
                if version - result["version"] > bound and result["version"] < self._latest[0]:
                    dropped += result["batch"].response_ids.shape[0]  # staler than the bound: generated again
                    self._send(chunk)  # with the newest weights (a worker applies them before the chunk)
                    continue
                results[chunk.worker] = result
        del self.steps[step]
        chunks = [(chunk.rows, results[chunk.worker]) for chunk in pending.chunks]
        waited = time.perf_counter() - t0
        tokens = sum(r["batch"].num_tokens for _, r in chunks)
        busy = max(r["seconds"] for _, r in chunks)
        self._timings = {
            "async/idle_s": waited,
            "async/queue_depth": float(ready_before),
            "async/steps_ahead": float(len(self.steps)),
            "async/worker_tokens_per_s": tokens / max(sum(r["seconds"] for _, r in chunks), 1e-9),
            "async/worker_generate_s": busy,
            "async/worker_sync_s": max(r["sync_s"] for _, r in chunks),
            "async/worker_weights_wait_s": max(r["weights_wait_s"] for _, r in chunks),
            "async/restarts": float(sum(self.restarts)),
        }
        batch, versions = merge_chunks(chunks)
        return VersionedRollouts(batch, versions, dropped=dropped)

    def _ready_steps(self) -> int:
        """Steps ahead whose every chunk is done (the queue of finished rollouts)."""
        refs = [c.ref for s in self.steps.values() for c in s.chunks]
        if not refs:
            return 0
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        done_ids = {r.hex() for r in done}
        return sum(all(c.ref.hex() in done_ids for c in s.chunks) for s in self.steps.values())

    def deliver(self, version: int, named_tensors: NamedTensors) -> None:
        t0 = time.perf_counter()
        ref = self.ray.put([(name, t.detach().cpu()) for name, t in named_tensors])  # the workers' own device
        self._latest = (version, ref)
        for worker in self.workers:
            worker.set_weights.options(concurrency_group="weights").remote(version, ref)
        self._publish_s = time.perf_counter() - t0

    def stats(self) -> dict[str, float]:
        """The last step's rollout timings and the last publish's (``async/publish_s``, once there was one)."""
        publish = {} if self._publish_s is None else {"async/publish_s": self._publish_s}
        return {**self._timings, **publish}

    def close(self) -> None:
        """Kill the workers; ``ray.shutdown()`` if this source initialized Ray: it stops a local cluster, and only
        disconnects from a cluster it joined (``address``), which keeps running (safe to call twice)."""
        ray = self.ray
        if not ray.is_initialized():
            return
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # already dead
                pass
        self.workers, self.steps = [], {}
        if self.initialized_ray:
            ray.shutdown()


def merge_chunks(chunks: list[tuple[list[int], dict[str, Any]]]) -> tuple[RolloutBatch, torch.Tensor]:
    """One rollout batch (and its ``[B]`` versions) from the workers' chunks: ``chunks`` holds, per chunk, which of the
    step's prompts it answered and its result (``batch``, ``version``). Rows keep each prompt's group contiguous;
    ``prompt_index`` points into the step's prompts; prompts are left-padded and responses right-padded to the
    longest, with the chunks' own padding id (masked positions are never read)."""
    batches = [r["batch"] for _, r in chunks]
    pads = [b.prompt_ids[~b.prompt_mask] for b in batches if (~b.prompt_mask).any()]
    pad_id = int(pads[0][0]) if pads else 0
    prompts = [ids[m].tolist() for b in batches for ids, m in zip(b.prompt_ids, b.prompt_mask)]
    responses = [ids[m].tolist() for b in batches for ids, m in zip(b.response_ids, b.response_mask)]
    prompt_ids, prompt_mask = pad_sequences(prompts, pad_id, "left")  # [B, P]
    response_ids, response_mask = pad_sequences(responses, pad_id, "right")  # [B, T]
    t = response_ids.shape[1]
    logprobs = torch.zeros(len(responses), t, dtype=torch.float32)  # [B, T]
    row = 0
    for b in batches:
        width = b.rollout_logprobs.shape[1]
        logprobs[row : row + b.rollout_logprobs.shape[0], :width] = b.rollout_logprobs.float()
        row += b.rollout_logprobs.shape[0]
    index = torch.cat(
        [torch.as_tensor(rows, dtype=torch.long)[b.prompt_index] for (rows, _), b in zip(chunks, batches)]
    )  # [B]
    versions = torch.cat(
        [
            torch.full((b.response_ids.shape[0],), r["version"], dtype=torch.long)
            for (_, r), b in zip(chunks, batches)
        ]
    )  # [B]
    if any(b.extras or b.routing is not None for b in batches):
        raise ValueError(
            "rollout workers return batches without extras or routing only (autoregressive, dense)"
        )
    supports = [b.support for b in batches if b.support is not None]
    if supports and len(supports) != len(batches):
        raise ValueError("rollout workers returned kept sets (RolloutBatch.support) for some chunks only")
    merged = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        rollout_logprobs=logprobs,
        finish_reason=[f for b in batches for f in b.finish_reason],
        prompt_index=index,
        support=SamplingSupport.cat(supports, t) if supports else None,
    )
    return merged, versions
