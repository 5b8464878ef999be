"""A LightningDataModule of task prompts with a resumable (stateful) train loader.

Determinism: sample ``i`` of a stream is ``task.sample(random.Random(f"{seed}/{stream}/{i}"))``, so
every sample is a pure function of ``(seed, stream, i)``: random access, no replay on resume, and
train and val are separate streams. With ``disjoint=True`` a train draw whose prompt is a val prompt
is redrawn (from ``.../{i}/{attempt}``), so validation never scores memorized prompts.

Resuming: Lightning 2.x saves ``loader.state_dict()`` for every train loader that has
``state_dict``/``load_state_dict`` (``CombinedLoader._state_dicts``, stored under
``loops.fit_loop.state_dict.combined_loader`` of the checkpoint) and calls ``load_state_dict`` on
restart before iterating again (``FitLoop._load_combined_loader_states``). :class:`PromptStream` is
such a loader. It has a length, which also turns off Lightning's one-batch prefetch
(``_PrefetchDataFetcher`` only prefetches unsized loaders), so the saved position is exactly the
number of batches handed to ``training_step``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from ais_lightning.tasks.base import Task, TaskSample

MAX_DISJOINT_ATTEMPTS = 1000
"""Redraws of a train sample whose prompt collides with a val prompt before giving up."""


RESERVED_KEYS = ("prompt", "solution")
"""Keys of a collated batch that are not task fields."""


def task_fields(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """A collated batch's task fields (what ``Task.reward`` receives besides prompts and completions)."""
    return {k: v for k, v in batch.items() if k not in RESERVED_KEYS}


def collate_samples(samples: Sequence[TaskSample]) -> dict[str, list[Any]]:
    """Batch of samples as lists: ``{"prompt": [...], "solution": [...], <field>: [...]}``.

    Strings stay Python lists (the default collate would try to tensorize fields).
    """
    if not samples:
        raise ValueError("collate_samples needs at least one sample")
    keys = list(samples[0].fields)
    for sample in samples:
        if list(sample.fields) != keys:
            raise ValueError(f"samples have different fields: {keys} vs {list(sample.fields)}")
    for reserved in RESERVED_KEYS:
        if reserved in keys:
            raise ValueError(f"a task field may not be called {reserved!r}")
    batch: dict[str, list[Any]] = {
        "prompt": [s.prompt for s in samples],
        "solution": [s.solution for s in samples],
    }
    for key in keys:
        batch[key] = [s.fields[key] for s in samples]
    return batch


def draw_sample(
    task: Task, seed: int, stream: str, index: int, exclude: frozenset[str] = frozenset()
) -> TaskSample:
    """Sample ``index`` of ``stream``: deterministic in ``(seed, stream, index)``, prompt not in ``exclude``."""
    sample = task.sample(random.Random(f"{seed}/{stream}/{index}"))
    attempt = 0
    while sample.prompt in exclude:
        attempt += 1
        if attempt > MAX_DISJOINT_ATTEMPTS:
            raise ValueError(
                f"{MAX_DISJOINT_ATTEMPTS} draws of {stream} sample {index} all hit val prompts; the task has too "
                "few distinct prompts for this val_size (lower val_size or set disjoint=False)"
            )
        sample = task.sample(random.Random(f"{seed}/{stream}/{index}/{attempt}"))
    return sample


class PromptStream:
    """Resumable train loader: batches of task samples, with ``state_dict``/``load_state_dict``.

    Finite mode (``size`` given): a fixed pool of ``size`` samples, reshuffled every epoch
    (the permutation is seeded by ``(seed, epoch)``); samples are drawn when first used and kept,
    so a large pool costs nothing up front. Infinite mode (``size=None``): every batch is
    fresh (global batch ``k`` holds stream samples ``k*batch_size ...``); an "epoch" is just
    ``batches_per_epoch`` batches so Lightning knows the length.

    With ``world_size > 1`` rank ``r`` gets global batches ``r, r + world_size, ...``; every rank has
    the same number of batches per epoch.

    The state is ``{"epoch", "batch"}`` (batches yielded in the current epoch). An iterator resumes
    from a loaded state; a saved state at the end of an epoch resumes at the start of the next one.
    Iterating again without a loaded state starts the next epoch.
    """

    def __init__(
        self,
        task: Task,
        batch_size: int,
        seed: int = 0,
        size: int | None = None,
        batches_per_epoch: int = 1000,
        exclude: frozenset[str] = frozenset(),
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        stream: str = "train",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if size is not None and size < 1:
            raise ValueError(f"size must be >= 1 or None (infinite), got {size}")
        if batches_per_epoch < 1:
            raise ValueError(f"batches_per_epoch must be >= 1, got {batches_per_epoch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.task, self.batch_size, self.seed, self.size = task, batch_size, seed, size
        self.batches_per_epoch, self.exclude, self.drop_last = batches_per_epoch, exclude, drop_last
        self.rank, self.world_size, self.stream = rank, world_size, stream
        if size is None:
            global_batches = batches_per_epoch * world_size
        else:
            global_batches = size // batch_size if drop_last else math.ceil(size / batch_size)
        self._len = global_batches // world_size
        if self._len == 0:
            raise ValueError(
                f"size={size} gives no batch of {batch_size} per rank for world_size={world_size}; "
                "lower batch_size or raise the train size"
            )
        # finite mode: the pool samples drawn so far (each drawn on first use, then kept)
        self._pool: dict[int, TaskSample] = {}
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation of the pool) cache
        self._epoch, self._batch, self._resume, self._started = 0, 0, False, False

    def __len__(self) -> int:
        return self._len

    def _global_indices(self, epoch: int, batch: int) -> list[int]:
        k = batch * self.world_size + self.rank  # global batch index within the epoch
        if self.size is None:
            start = (epoch * self._len * self.world_size + k) * self.batch_size
            return list(range(start, start + self.batch_size))
        if self._order is None or self._order[0] != epoch:
            order = list(range(self.size))
            random.Random(f"{self.seed}/{self.stream}/epoch/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1][k * self.batch_size : (k + 1) * self.batch_size]

    def _sample(self, index: int) -> TaskSample:
        if self.size is None:
            return draw_sample(self.task, self.seed, self.stream, index, self.exclude)
        if index not in self._pool:
            self._pool[index] = draw_sample(self.task, self.seed, self.stream, index, self.exclude)
        return self._pool[index]

    def batch(self, epoch: int, batch: int) -> dict[str, list[Any]]:
        """Batch ``batch`` of ``epoch`` for this rank (pure function of the arguments)."""
        return collate_samples([self._sample(i) for i in self._global_indices(epoch, batch)])

    def __iter__(self) -> Iterator[dict[str, list[Any]]]:
        # A generator: the position is decided at the first next(), so an iterator that is created and
        # dropped unused (Lightning's iterable check) does not move the epoch.
        if self._resume:
            self._resume = False
            if self._batch >= self._len:
                self._epoch, self._batch = self._epoch + 1, 0
        elif self._started:
            self._epoch, self._batch = self._epoch + 1, 0
        self._started = True
        while self._batch < self._len:
            out = self.batch(self._epoch, self._batch)
            self._batch += 1  # counted before yielding: state_dict() during the step includes this batch
            yield out

    def upcoming(self, n: int) -> list[dict[str, list[Any]]]:
        """The ``n`` batches after those yielded so far, without moving the position (a pure function of the state):
        an asynchronous run's rollout workers generate for the next steps' prompts ahead of them."""
        out, epoch, batch = [], self._epoch, self._batch
        for _ in range(n):
            if batch >= self._len:
                epoch, batch = epoch + 1, 0
            out.append(self.batch(epoch, batch))
            batch += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "batch": self._batch, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in ("epoch", "batch"):
            if not isinstance(state_dict.get(key), int) or state_dict[key] < 0:
                raise ValueError(
                    f"PromptStream state_dict needs a non-negative int {key!r}, got {state_dict}"
                )
        for key in ("seed", "size"):
            if key in state_dict and state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"PromptStream state was saved with {key}={state_dict[key]!r} but this loader has "
                    f"{key}={getattr(self, key)!r}"
                )
        self._epoch, self._batch, self._resume = state_dict["epoch"], state_dict["batch"], True


class PromptDataModule(L.LightningDataModule):
    """Prompts of a :class:`~ais_lightning.tasks.base.Task` for SFT/GRPO.

    Batches are dicts of lists, ``{"prompt", "solution", <task fields>}``. The train loader is a
    :class:`PromptStream` (resumable from a Lightning checkpoint); the val loader is a plain
    ``DataLoader`` over ``val_size`` fixed samples (Lightning shards it under DDP).

    Args:
        task: the task (see :func:`~ais_lightning.tasks.get_task`).
        train_size: samples in the train pool; None = an endless stream of fresh samples.
        val_size: val samples (0 = no val loader).
        batch_size: prompts per train batch (per rank).
        seed: everything is a deterministic function of it.
        val_batch_size: prompts per val batch; None = ``batch_size``.
        disjoint: redraw train samples whose prompt is a val prompt.
        batches_per_epoch: epoch length in infinite mode.
        drop_last: drop a last partial train batch (finite mode).
        val_task: draw val samples from this task instead (e.g. a GSM8K test file); disjointness is
            then by construction of the files and not checked.
    """

    def __init__(
        self,
        task: Task,
        train_size: int | None = None,
        val_size: int = 64,
        batch_size: int = 32,
        seed: int = 0,
        val_batch_size: int | None = None,
        disjoint: bool = True,
        batches_per_epoch: int = 1000,
        drop_last: bool = False,
        val_task: Task | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(task, Task):
            raise ValueError(
                f"task must be a Task (see ais_lightning.tasks.get_task), got {type(task).__name__}"
            )
        if val_size < 0:
            raise ValueError(f"val_size must be >= 0, got {val_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if val_batch_size is not None and val_batch_size < 1:
            raise ValueError(f"val_batch_size must be >= 1 or None, got {val_batch_size}")
        if train_size is not None and train_size < 1:
            raise ValueError(f"train_size must be >= 1 or None (infinite), got {train_size}")
        self.task, self.val_task = task, val_task
        self.train_size, self.val_size, self.batch_size, self.seed = train_size, val_size, batch_size, seed
        self.val_batch_size = val_batch_size or batch_size
        self.disjoint, self.batches_per_epoch, self.drop_last = disjoint, batches_per_epoch, drop_last
        self._val: list[TaskSample] | None = None
        self._train: PromptStream | None = None

    def val_samples(self) -> list[TaskSample]:
        """The fixed val samples (stream ``"val"``)."""
        if self._val is None:
            source = self.val_task or self.task
            self._val = [draw_sample(source, self.seed, "val", i) for i in range(self.val_size)]
        return self._val

    def train_stream(self) -> PromptStream:
        """The train loader; one object for the module's lifetime so its position survives reloads."""
        if self._train is None:
            trainer = self.trainer
            rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
            check = self.disjoint and self.val_task is None
            exclude = frozenset(s.prompt for s in self.val_samples()) if check else frozenset()
            self._train = PromptStream(
                self.task,
                self.batch_size,
                seed=self.seed,
                size=self.train_size,
                batches_per_epoch=self.batches_per_epoch,
                exclude=exclude,
                drop_last=self.drop_last,
                rank=rank,
                world_size=world,
            )
        return self._train

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.train_stream()

    def train_dataloader(self) -> PromptStream:
        return self.train_stream()

    def val_dataloader(self) -> DataLoader | list:
        if self.val_size == 0:
            return []
        return DataLoader(self.val_samples(), batch_size=self.val_batch_size, collate_fn=collate_samples)
