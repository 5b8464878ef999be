"""A real 2-process gloo run: AIS (v2, both bases) and AISv1 on each rank use the lambda of the global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.gloo import free_port


@pytest.fixture
def worker(monkeypatch):
    """The worker module, importable by name (spawned children inherit the parent's sys.path)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    import corrector_dist_worker

    return corrector_dist_worker


def global_batch(worker, scenario: str, step: int) -> dict[str, torch.Tensor]:
    shards = [worker.make_shard(scenario, rank, step) for rank in range(2)]
    return {key: torch.cat([s[key] for s in shards]) for key in shards[0]}


@pytest.mark.parametrize("name", ["ais", "ais_default", "ais_mis", "ais_entropy_bound", "ais_v1"])
def test_ranks_see_different_local_lambdas(worker, name):
    """Without the all-reduce the ranks would disagree, so the slow test below can fail."""
    local = [
        worker.run_steps(name, lambda step, r=rank: worker.make_shard("uneven", r, step)) for rank in (0, 1)
    ]
    lams = [local[rank][0]["stats"]["ais/lambda"] for rank in (0, 1)]
    assert lams[0] != pytest.approx(lams[1], rel=0.1, abs=0.05)


@pytest.mark.slow
def test_two_process_lambda_equals_single_process_on_the_global_batch(tmp_path, worker):
    mp.spawn(worker.run, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    per_rank = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    rows = [0, 4, 6]  # rank 0 holds rows 0..3, rank 1 rows 4..5
    for name in worker.CORRECTORS:
        for scenario in worker.SCENARIOS:
            expected = worker.run_steps(name, lambda step, s=scenario: global_batch(worker, s, step))
            for step in range(2):
                want = expected[step]
                keys = [k for k in want["stats"] if k.startswith("ais/")]
                assert "ais/lambda" in keys
                for rank in range(2):
                    got = per_rank[rank][(name, scenario)][step]
                    for key in keys:
                        assert got["stats"][key] == pytest.approx(want["stats"][key], rel=1e-6, abs=1e-9), (
                            name,
                            scenario,
                            step,
                            rank,
                            key,
                        )
                    torch.testing.assert_close(got["weights"], want["weights"][rows[rank] : rows[rank + 1]])
