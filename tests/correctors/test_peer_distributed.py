"""A real 2-process gloo run: batch-statistics correctors equal the single process on the global batch.

Batch-normalised TIS (alone and inside ``DivergenceRejection``) all-reduces its mean, M2PO gathers
the squared log-ratios to find its cut, PSIS gathers each rank's largest log-weights to fit the
tail: on every rank the weights, masks and the batch-level stats must equal those computed on the
concatenated batch in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.gloo import free_port

BATCH_STATS = ("tis/batch_norm_factor", "m2po/", "psis/")


@pytest.fixture
def worker(monkeypatch):
    """The worker module, importable by name (spawned children inherit the parent's sys.path)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    import peer_dist_worker

    return peer_dist_worker


def test_a_rank_alone_sees_a_different_batch_statistic(worker):
    """Without the collectives the ranks would disagree, so the 2-process test below can fail."""
    alone = worker.run_all(worker.make_shard("uneven", 0))
    together = worker.run_all(worker.global_batch("uneven"))
    for name in worker.build():
        local_stats = {k: v for k, v in alone[name].stats.items() if k.startswith(BATCH_STATS)}
        global_stats = {k: v for k, v in together[name].stats.items() if k.startswith(BATCH_STATS)}
        assert local_stats and local_stats != pytest.approx(global_stats, rel=1e-3), name
    assert together["m2po"].stats["m2po/masked_frac"] > 0.05  # the cut is exercised
    assert together["psis"].stats["psis/fitted"] == 1.0 and together["psis_seq"].stats["psis/fitted"] == 1.0


@pytest.mark.slow
def test_two_processes_equal_one_process_on_the_global_batch(tmp_path, worker):
    mp.spawn(worker.run, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    per_rank = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    bounds = [0, worker.ROWS[0], sum(worker.ROWS)]
    for scenario in worker.SCENARIOS:
        expected = worker.run_all(worker.global_batch(scenario))
        for name, want in expected.items():
            for rank in range(2):
                got = per_rank[rank][scenario][name]
                rows = slice(bounds[rank], bounds[rank + 1])
                torch.testing.assert_close(got["weights"], want.weights[rows], rtol=1e-6, atol=1e-7)
                assert torch.equal(got["mask"], want.mask[rows]), (scenario, name, rank)
                for key in [k for k in want.stats if k.startswith(BATCH_STATS)]:
                    assert got["stats"][key] == pytest.approx(want.stats[key], rel=1e-9, abs=1e-12), (
                        scenario,
                        name,
                        rank,
                        key,
                    )
