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


def test_engine_start_puts_back_the_trainers_rngs_and_matmul_precision(monkeypatch):
    """vLLM's worker reseeds every RNG to the engine's seed and sets the float32 matmul precision to
    ``VLLM_FLOAT32_MATMUL_PRECISION`` ("highest") when it starts (the stand-in does what ``gpu_worker.py`` does):
    the trainer's RNG streams and its TF32 setting are what they were once the engine is built."""
    import random

    import numpy as np

    from ais_lightning.rollout.vllm_engine import VLLMRolloutEngine

    stand_in_vllm(monkeypatch)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.set_float32_matmul_precision("high")  # the trainer's TF32
    engine = None
    try:
        before = (random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state())
        engine = VLLMRolloutEngine(build_tiny_qwen3(seed=0), precision="fp32", seed=5)
        assert torch.get_float32_matmul_precision() == "high"
        assert random.getstate() == before[0]
        assert np.array_equal(np.random.get_state()[1], before[1])
        assert torch.equal(torch.random.get_rng_state(), before[2])
    finally:
        torch.set_float32_matmul_precision("highest")
        if engine is not None:
            engine.close()


def test_engine_start_puts_back_every_cuda_generator(monkeypatch, tmp_path):
    """On a GPU the worker's ``set_random_seed`` also seeds every CUDA generator (``torch.cuda.manual_seed_all``):
    without restoring them, every engine start (every run of a sweep) restarted the trainer's CUDA stream at the
    engine's seed. A pretend GPU whose one generator state the stand-in's seeding overwrites."""
    import torch.distributed as dist

    from ais_lightning.rollout import engine_args
    from ais_lightning.rollout.vllm_engine import VLLMRolloutEngine
    from tests.gpu.fake_cuda import fake_cuda

    build_tiny_qwen3(seed=0).save_pretrained(tmp_path)
    stand_in_vllm(monkeypatch, on_cpu=False)
    monkeypatch.setattr(engine_args, "package_version", lambda dist: (0, 33, 0))
    fake_cuda(monkeypatch, capability=(9, 0), count=1, current=0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    generator = {"state": torch.tensor([7, 7], dtype=torch.uint8)}  # the trainer's CUDA RNG, mid-stream
    monkeypatch.setattr(
        torch.cuda,
        "manual_seed_all",
        lambda seed: generator.update(state=torch.tensor([seed, 0], dtype=torch.uint8)),
    )
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [generator["state"].clone()])
    monkeypatch.setattr(
        torch.cuda, "set_rng_state_all", lambda states: generator.update(state=states[0].clone())
    )
    engine = VLLMRolloutEngine(str(tmp_path), precision="bf16", seed=5)
    try:
        assert engine.device == torch.device("cuda", 0)
        assert generator["state"].tolist() == [7, 7]  # not [5, 0]: the engine's seed
    finally:
        engine.close()


def test_sampling_leaves_the_trainers_rngs_alone(monkeypatch):
    """``SamplingConfig.seed=None``: vLLM's V2 model runner would draw each request's seed from the global numpy
    RNG (the stand-in does as ``SamplingStates.add_request``). Every request carries a seed from the engine's own
    generator instead, and an engine built with the same seed draws the same seeds. vLLM's CPU sampler also draws
    from torch's global generator at every step whatever the seeds (the stand-in draws once per call): the
    engine puts it back. The trainer's numpy and torch streams are where they were."""
    import numpy as np

    from ais_lightning.rollout.vllm_engine import VLLMRolloutEngine

    vllm = stand_in_vllm(monkeypatch)
    seeds = []
    for _ in range(2):
        engine = VLLMRolloutEngine(build_tiny_qwen3(seed=0), precision="fp32", seed=3)
        try:
            np.random.seed(11), torch.manual_seed(12)
            before = np.random.get_state()[1].copy(), torch.random.get_rng_state()
            engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=3, seed=None))
            engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=3, seed=7))
            assert np.array_equal(np.random.get_state()[1], before[0])
            assert torch.equal(torch.random.get_rng_state(), before[1])
        finally:
            engine.close()
        seeds.append(list(vllm.request_seeds))
        vllm.request_seeds.clear()
    assert all(s is not None for s in seeds[0]) and len(set(seeds[0])) == 2 * len(PROMPTS)
    assert seeds[0] == seeds[1]  # reproducible from the engine's seed
