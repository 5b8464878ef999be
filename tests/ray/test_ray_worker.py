"""One rollout worker's weights, without a cluster: Ray runs ``set_weights`` and ``generate`` in two threads and orders
calls only within a thread, so a chunk that must use the weights published before it waits for them."""

from __future__ import annotations

import threading

import torch

from ais_lightning.rollout import SamplingConfig
from ais_lightning.rollout.ray_workers import RolloutWorker
from tests.ray.helpers import tiny_parts

SAMPLING = SamplingConfig(n=2, max_new_tokens=3, seed=1)


def test_a_chunk_waits_for_the_weights_published_before_it_then_uses_them():
    model, factory, weights = tiny_parts()
    worker = RolloutWorker(model, factory, torch.get_num_threads(), version=0, weights=weights)
    assert (
        worker.generate([[5, 6]], SAMPLING)["version"] == 0
    )  # nothing newer asked for: the weights it holds

    moved = [(name, t + 0.05) for name, t in weights]
    out: dict = {}
    chunk = threading.Thread(target=lambda: out.update(worker.generate([[5, 6]], SAMPLING, min_version=1)))
    chunk.start()
    chunk.join(timeout=1.0)
    assert (
        chunk.is_alive()
    )  # version 1's weights have not arrived: the chunk waits rather than use version 0's
    worker.set_weights(1, moved)
    chunk.join(timeout=60)
    assert not chunk.is_alive() and out["version"] == 1
    assert (
        out["weights_wait_s"] > 0.5
    )  # waiting from (about) the thread's start until the publish, a second later

    reference = factory(model)
    reference.sync_weights(moved)
    expected = reference.generate([[5, 6]], SAMPLING)
    assert torch.equal(out["batch"].response_ids, expected.response_ids)  # generated with version 1's weights
    torch.testing.assert_close(out["batch"].rollout_logprobs, expected.rollout_logprobs)


def test_a_worker_skips_to_the_newest_weights_it_holds():
    model, factory, weights = tiny_parts()
    worker = RolloutWorker(model, factory, torch.get_num_threads(), version=0, weights=weights)
    worker.set_weights(2, [(name, t + 0.02) for name, t in weights])
    worker.set_weights(1, [(name, t + 0.01) for name, t in weights])  # arrives late: older than what it holds
    assert worker.generate([[5]], SAMPLING, min_version=1)["version"] == 2
