"""One vLLM engine per run, released before another is built (a stand-in vLLM counts the live engines).

vLLM holds its share of the GPU (weights, KV cache, CUDA graphs) until its engine core shuts down; dropping
the ``LLM`` object does not release it (vLLM freezes its start-up objects out of the garbage collector until
that shutdown). ``VLLMRolloutEngine.close`` shuts it down, and ``ais-train`` closes its engines when a run
ends, so a sweep's next run in the same process (Hydra's basic launcher) starts with the memory free.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ais_lightning.models import build_tiny_qwen3
from ais_lightning.rollout import SamplingConfig
from tests.gloo import free_port
from tests.rollout.vllm_stand_in import stand_in_vllm

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]


def test_close_shuts_vllm_down_and_keeps_the_trainers_process_group(monkeypatch):
    """``close`` releases vLLM (its engine core's shutdown) and the model directory it saved; the trainer's
    process group, which vLLM's shutdown would destroy (it destroys torch.distributed's default group), stays."""
    from ais_lightning.rollout.vllm_engine import VLLMRolloutEngine

    vllm = stand_in_vllm(monkeypatch)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        engine = VLLMRolloutEngine(build_tiny_qwen3(seed=0), precision="fp32")
        model_dir = engine.model_path
        assert vllm.live == 1 and __import__("os").path.isdir(model_dir)
        engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=4, seed=0))
        engine.close()
        assert vllm.live == 0 and vllm.shutdowns == 1  # released, not only dereferenced
        assert not __import__("os").path.exists(model_dir)
        assert dist.is_initialized()  # the trainer's group survived vLLM's shutdown
        dist.barrier()
        engine.close()  # idempotent
        assert vllm.shutdowns == 1
        with pytest.raises(RuntimeError, match="closed"):
            engine.generate(PROMPTS, SamplingConfig(max_new_tokens=2))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_ais_train_runs_one_vllm_engine_and_releases_it(monkeypatch, tmp_path):
    """Two ``ais-train`` runs in one process (a sweep under Hydra's basic launcher) with ``rollout=vllm_cpu``:
    each builds one vLLM engine, for its validation before training and its training, and releases it when it
    ends, before the next run builds its own."""
    from ais_lightning.app import train
    from ais_lightning.app.config import compose_train_config

    vllm = stand_in_vllm(monkeypatch)
    monkeypatch.setenv("AIS_LIGHTNING_CACHE", str(tmp_path / "cache"))
    for run in range(2):
        cfg = compose_train_config(
            [
                "experiment=smoke",
                "trainer.num_threads=1",
                "rollout=vllm_cpu",
                f"output_dir={tmp_path / str(run)}",
            ]
        )
        summary = train.run(cfg)
        assert summary["status"] == "finished"
        assert len(vllm.started) == run + 1  # one engine for the validation before training and for training
        assert vllm.live == 0  # released when the run ended, not when the garbage collector gets to it
    assert vllm.max_live == 1
    assert torch.get_num_threads() >= 1
