"""The in-process rollout source: the synchronous loop, and the deterministic lag (generation with exactly the kept
weights of ``lag`` versions ago), with ``wait`` and ``drop`` beyond the bound."""

from __future__ import annotations

import pytest
import torch

from ais_lightning.rollout import RolloutBatch, RolloutEngine, SamplingConfig
from ais_lightning.rollout.sources import InlineSource, RolloutRequest, VersionedRollouts
from ais_lightning.staleness import WeightSnapshots


class Weighed(RolloutEngine):
    """An engine whose one weight is written into every log-prob it returns (which weights generated a batch)."""

    def __init__(self) -> None:
        self.weight, self.syncs = 0.0, 0

    def sync_weights(self, named_tensors):
        self.weight, self.syncs = float(dict(named_tensors)["w"]), self.syncs + 1

    def generate(self, prompts, sampling):
        rows = len(prompts) * sampling.n
        return RolloutBatch(
            prompt_ids=torch.ones(rows, 1, dtype=torch.long),
            prompt_mask=torch.ones(rows, 1, dtype=torch.bool),
            response_ids=torch.ones(rows, 2, dtype=torch.long),
            response_mask=torch.ones(rows, 2, dtype=torch.bool),
            rollout_logprobs=torch.full((rows, 2), -self.weight),
            finish_reason=["length"] * rows,
            prompt_index=torch.arange(len(prompts)).repeat_interleave(sampling.n),
        )


REQUEST = RolloutRequest([[1], [2]], SamplingConfig(n=2))


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.tensor(float(version)))]  # version v's weights are the number v


def run(source: InlineSource, snaps: WeightSnapshots | None, steps: int) -> list[VersionedRollouts]:
    """``steps`` rollout steps: rollouts of step s at version s, then version s + 1 published."""
    out = []
    for step in range(steps):
        out.append(source.rollouts(step, REQUEST, version=step))
        if snaps is not None:
            snaps.put(step + 1, weights(step + 1))
        source.publish(step + 1, weights(step + 1))
    return out


def generated_by(rollouts: VersionedRollouts) -> int:
    return int(-rollouts.batch.rollout_logprobs[0, 0])


def test_the_synchronous_loop_syncs_after_every_update():
    engine = Weighed()
    out = run(InlineSource(engine), None, 4)
    assert [generated_by(r) for r in out] == [0, 1, 2, 3]
    assert all(r.versions.tolist() == [s] * 4 and r.dropped == 0 for s, r in enumerate(out))
    assert engine.syncs == 4


def test_a_lag_generates_with_the_weights_of_exactly_lag_versions_ago():
    engine, snaps = Weighed(), WeightSnapshots(keep=3)
    snaps.put(0, weights(0))
    out = run(InlineSource(engine, snaps, lag=[2], bound=2), snaps, 6)
    assert [generated_by(r) for r in out] == [0, 0, 0, 1, 2, 3]  # the pipeline fills, then 2 versions behind
    assert [int(r.versions[0]) for r in out] == [0, 0, 0, 1, 2, 3]
    assert engine.syncs == 3  # once per new version generated with, never at publish


@pytest.mark.parametrize(
    ("on_stale", "generated", "dropped"),
    [("wait", [0, 0, 1, 2, 3, 4], [0] * 6), ("drop", [0, 0, 2, 3, 4, 5], [0, 0, 4, 4, 4, 4])],
)
def test_beyond_the_bound_wait_or_drop(on_stale, generated, dropped):
    snaps = WeightSnapshots(keep=4)
    snaps.put(0, weights(0))
    source = InlineSource(Weighed(), snaps, lag=[3], bound=1, on_stale=on_stale)
    out = run(source, snaps, 6)
    assert [generated_by(r) for r in out] == generated
    assert [r.dropped for r in out] == dropped
    assert all(s - int(r.versions[0]) <= 1 for s, r in enumerate(out))  # never staler than the bound


def test_a_lag_needs_snapshots():
    with pytest.raises(ValueError, match="needs the snapshots"):
        InlineSource(Weighed(), None, lag=[0, 1])


def test_versioned_rollouts_check_their_versions():
    batch = Weighed().generate([[1]], SamplingConfig(n=2))
    with pytest.raises(ValueError, match=r"versions must be a \[B\] long tensor with B = 2 rows"):
        VersionedRollouts(batch, torch.zeros(3, dtype=torch.long))
