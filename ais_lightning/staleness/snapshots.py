"""The trainer's full weights of the last few policy versions (CPU copies), by version.

An asynchronous run trains on rows generated up to ``max_staleness`` versions ago. Two things need the weights of
those versions: the deterministic in-process source, which generates from exactly the weights a pipeline of that
depth would have used (:class:`ais_lightning.rollout.sources.InlineSource`), and the split of the mismatch into
its precision and staleness parts, which scores each row at the trainer's precision with the weights that
generated it (``ais_lightning.modules.version_scorer.VersionScorer``). Each kept version costs one full copy of
the model in host memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightSnapshots:
    """The full weights of the newest ``keep`` versions, as detached CPU copies.

    Example:
        >>> import torch
        >>> from ais_lightning.staleness import WeightSnapshots
        >>> snaps = WeightSnapshots(keep=2)
        >>> w = torch.zeros(2)
        >>> for v in range(3):
        ...     snaps.put(v, [("w", w)])
        ...     _ = w.add_(1.0)  # the live weights move on; the snapshot does not
        >>> snaps.versions(), snaps.get(1)[0][1].tolist()
        ([1, 2], [1.0, 1.0])
    """

    def __init__(self, keep: int) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (versions kept), got {keep!r}")
        self.keep = keep
        self._store: OrderedDict[int, NamedTensors] = OrderedDict()

    def put(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep a copy of ``version``'s weights (newer than every kept one), forgetting the oldest beyond ``keep``."""
        if self._store and version <= next(reversed(self._store)):
            raise ValueError(
                f"version {version} is not newer than the newest kept version {next(reversed(self._store))}"
            )
        self._store[version] = [(n, t.detach().to("cpu", copy=True)) for n, t in named_tensors]
        while len(self._store) > self.keep:
            self._store.popitem(last=False)

    def get(self, version: int) -> NamedTensors:
        """The weights of ``version``; KeyError naming the kept versions when it is not kept."""
        if version not in self._store:
            raise KeyError(f"policy version {version} is not kept (kept: {self.versions()})")
        return self._store[version]

    def versions(self) -> list[int]:
        """The kept versions, oldest first."""
        return list(self._store)

    def __contains__(self, version: object) -> bool:
        return version in self._store

    def state_dict(self) -> dict[str, Any]:
        """For checkpoints: the kept versions and their weights."""
        return {"keep": self.keep, "versions": {v: list(t) for v, t in self._store.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the newest ``keep`` of its versions)."""
        versions = state.get("versions")
        if not isinstance(versions, dict):
            raise ValueError(
                f"a WeightSnapshots state needs a 'versions' dict, got {type(versions).__name__}"
            )
        self._store.clear()
        for version in sorted(versions):
            self.put(int(version), versions[version])
