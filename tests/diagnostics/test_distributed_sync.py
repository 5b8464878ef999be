"""A real 2-process gloo sync: compute() on each rank equals the single-process value over all data."""

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
    import diagnostics_dist_worker

    return diagnostics_dist_worker


@pytest.mark.slow
def test_two_process_gloo_sync_equals_single_process(tmp_path, worker):
    mp.spawn(worker.run, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    per_rank = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]

    for scenario in worker.SCENARIOS:
        # single process, no process group: one metric updated with both shards
        metrics = worker.build_metrics()
        for rank in range(2):
            worker.update(metrics, worker.make_shard(scenario, rank))
        expected = worker.compute(metrics)
        assert len(expected) == 51  # 48 collection metrics + entropy + 2 correction fractions
        for rank in range(2):
            got = per_rank[rank][scenario]
            assert got.keys() == expected.keys()
            for name, want in expected.items():
                assert got[name] == pytest.approx(want, rel=1e-9, abs=1e-12), (scenario, rank, name)


def test_shards_are_not_trivial(worker):
    """The sync test would pass vacuously if a rank's own value already equalled the global one."""
    local = worker.build_metrics()
    worker.update(local, worker.make_shard("uneven", 0))
    both = worker.build_metrics()
    for rank in range(2):
        worker.update(both, worker.make_shard("uneven", rank))
    local_values, global_values = worker.compute(local), worker.compute(both)
    differing = [name for name in global_values if local_values[name] != pytest.approx(global_values[name])]
    # These shards do not exercise the extremes of some peer metrics; test_peer_metrics_distributed.py
    # covers those with shards built for them.
    exercised_elsewhere = {
        "mismatch/log_ppl_diff_max",
        "mismatch/psis_khat_seq",
        "mismatch/seq_ratio_frac_below",
        "mismatch/seq_ratio_min",
        "mismatch/seq_mult_prob_error_min",
    }
    missing = set(global_values) - set(differing) - exercised_elsewhere
    assert not missing, sorted(missing)
