"""Merging the rollout workers' chunks into one step's batch (no Ray needed), and the message without Ray."""

from __future__ import annotations

import sys

import pytest
import torch

from ais_lightning.rollout import RolloutBatch
from ais_lightning.rollout.ray_workers import MISSING_RAY, RayWorkers, import_ray, merge_chunks


def _batch(prompts: list[list[int]], responses: list[list[int]], n: int, pad: int = 9) -> RolloutBatch:
    rows = [p for p in prompts for _ in range(n)]
    width_p, width_r = max(map(len, rows)), max(map(len, responses))
    return RolloutBatch(
        prompt_ids=torch.tensor([[pad] * (width_p - len(p)) + p for p in rows]),
        prompt_mask=torch.tensor([[False] * (width_p - len(p)) + [True] * len(p) for p in rows]),
        response_ids=torch.tensor([r + [pad] * (width_r - len(r)) for r in responses]),
        response_mask=torch.tensor([[True] * len(r) + [False] * (width_r - len(r)) for r in responses]),
        rollout_logprobs=torch.tensor(
            [[-0.1 * (i + 1)] * len(r) + [0.0] * (width_r - len(r)) for i, r in enumerate(responses)]
        ),
        finish_reason=["stop"] * len(responses),
        prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
    )


def test_chunks_merge_into_groups_that_point_at_the_step_prompts():
    # step prompts 0..2 dealt to two workers: worker 0 answered prompts 0 and 2, worker 1 prompt 1 (two rows each)
    a = _batch([[1, 2, 3], [7]], [[4], [5, 6], [8, 8, 8], [2]], n=2)
    b = _batch([[5, 5]], [[1, 1], [3]], n=2)
    merged, versions = merge_chunks([([0, 2], {"batch": a, "version": 4}), ([1], {"batch": b, "version": 5})])
    assert merged.prompt_index.tolist() == [0, 0, 2, 2, 1, 1]
    assert versions.tolist() == [4, 4, 4, 4, 5, 5]
    prompts = [ids[m].tolist() for ids, m in zip(merged.prompt_ids, merged.prompt_mask)]
    assert prompts == [[1, 2, 3], [1, 2, 3], [7], [7], [5, 5], [5, 5]]
    responses = [ids[m].tolist() for ids, m in zip(merged.response_ids, merged.response_mask)]
    assert responses == [[4], [5, 6], [8, 8, 8], [2], [1, 1], [3]]
    assert merged.rollout_logprobs.shape == (6, 3) and merged.rollout_logprobs[2].tolist() == pytest.approx(
        [-0.3] * 3
    )
    assert merged.rollout_logprobs[5].tolist() == pytest.approx([-0.2, 0.0, 0.0])  # 0 where masked
    assert int(merged.prompt_ids[2, 0]) == 9  # the chunks' own padding id


def test_the_workers_kept_sets_follow_their_rows():
    """Truncated sampling on the workers: each chunk's kept sets (RolloutBatch.support) land on its rows of the
    merged batch, whose responses are wider; a chunk without them next to one with them is refused."""
    import dataclasses

    from ais_lightning.rollout import SamplingSupport

    a = _batch([[1, 2]], [[4], [5, 6]], n=2)
    a = dataclasses.replace(a, support=SamplingSupport(torch.tensor([[2, 0], [1, 3]], dtype=torch.int32),
                                                       torch.tensor([[4, 7, -1, -1], [5, 6, 1, 2]], dtype=torch.int32)))  # fmt: skip
    b = _batch([[3]], [[1, 1, 1], [3]], n=2)
    b = dataclasses.replace(b, support=SamplingSupport(torch.tensor([[1, 1, 2], [1, 0, 0]], dtype=torch.int32),
                                                       torch.tensor([[1, 1, 0, 1], [3, -1, -1, -1]], dtype=torch.int32)))  # fmt: skip
    merged, _ = merge_chunks([([0], {"batch": a, "version": 0}), ([1], {"batch": b, "version": 0})])
    assert merged.support.counts.tolist() == [[2, 0, 0], [1, 3, 0], [1, 1, 2], [1, 0, 0]]
    flat = merged.support.flat(merged.response_mask)
    assert flat.ids.tolist() == [4, 7, 5, 6, 1, 2, 1, 1, 0, 1, 3]
    with pytest.raises(ValueError, match="for some chunks only"):
        merge_chunks(
            [([0], {"batch": a, "version": 0}), ([1], {"batch": _batch([[3]], [[1]], n=1), "version": 0})]
        )


def test_without_ray_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"ais-lightning\[ray\]"):
        import_ray()
    assert "make install" in MISSING_RAY


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_workers", 0, "num_workers must be an int >= 1"),
        ("num_cpus", -1, "num_cpus must be a number >= 0"),
        ("timeout_s", 0, "timeout_s must be a number > 0"),
        ("resources", {"rollout": -1}, "resources must map resource names to numbers >= 0"),
        ("max_restarts", -1, "max_restarts must be an int >= 0"),
    ],
)
def test_worker_settings_name_a_bad_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        RayWorkers(**{field: value})
