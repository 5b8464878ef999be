"""A real 2-process gloo sync of every ``MismatchDiagnostics`` metric: the verl / TRL / NeMo-RL / prime-rl ones
(per-task ones included) and PSIS k-hat."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.gloo import free_port

NEW = ("ppl", "log_ppl", "ratio_std", "ess_clipped", "seq_ratio", "abs_log_ratio", "psis_khat", "khat16")
NEW += ("mult_prob_error", "kl_reverse", "policy_kl_error", "js", "probs_", "kl_k3_", "by_task")  # alignment


@pytest.fixture
def worker(monkeypatch):
    """The worker module, importable by name (spawned children inherit the parent's sys.path)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    import peer_metrics_dist_worker

    return peer_metrics_dist_worker


def single_process(worker, scenario: str) -> dict[str, float]:
    metrics = worker.build_metrics()
    for rank in range(2):
        worker.update(metrics, worker.make_shard(scenario, rank))
    return worker.compute(metrics)


def test_shards_are_not_trivial(worker):
    """A rank's own value differs from the global one for every new metric (else the sync test is vacuous)."""
    local = worker.build_metrics()
    worker.update(local, worker.make_shard("uneven", 0))
    local_values, global_values = worker.compute(local), single_process(worker, "uneven")
    for name, want in global_values.items():
        if any(key in name for key in NEW):
            assert local_values[name] != pytest.approx(want, rel=1e-6), name
    assert global_values["mismatch/psis_khat"] > 0.3 and global_values["mismatch/psis_khat_seq"] != 0.0


@pytest.mark.slow
def test_two_process_sync_equals_single_process(tmp_path, worker):
    mp.spawn(worker.run, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    per_rank = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for scenario in worker.SCENARIOS:
        expected = single_process(worker, scenario)
        for rank in range(2):
            got = per_rank[rank][scenario]
            assert got.keys() == expected.keys()
            for name, want in expected.items():
                assert got[name] == pytest.approx(want, rel=1e-9, abs=1e-12), (scenario, rank, name)
