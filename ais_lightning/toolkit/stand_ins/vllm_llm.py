"""A stand-in ``vllm`` package: an in-process ``LLM`` that samples with the torch engine, and does to the process
what vLLM's worker does when it starts.

:class:`StandInVLLM` is the ``vllm`` module (:func:`vllm_modules` gives it and ``vllm.platforms`` for
``sys.modules``). Its ``LLM`` generates with :class:`~ais_lightning.rollout.TorchRolloutEngine` (fp32, on the saved
model directory the engine hands it) and answers the calls ``VLLMRolloutEngine`` makes:
``collective_rpc("reload_weights", ...)``, ``reset_prefix_cache``, ``generate`` (RequestOutput-like objects with
per-token log-probs). Read at vLLM 0.33.0:

- starting an ``LLM`` does what the worker does to the process: ``set_random_seed(seed)`` (``random``, numpy,
  torch and every CUDA generator, ``vllm/utils/torch_utils.py``) and
  ``torch.set_float32_matmul_precision(VLLM_FLOAT32_MATMUL_PRECISION)``, default ``"highest"``
  (``v1/worker/gpu_worker.py``, ``Worker.__init__``);
- a request without a seed draws one from the global numpy RNG, as the V2 model runner does
  (``v1/worker/gpu/sample/states.py``, ``SamplingStates.add_request``); ``request_seeds`` records every request's
  seed as the engine sent it; and every ``generate`` draws one seed per request from torch's global generator,
  as vLLM's CPU sampler does at every step before it overwrites the seeded rows
  (``v1/sample/ops/topk_topp_sampler.py``, ``TopKTopPSampler.forward_cpu``);
- an ``LLM`` is live from its construction until ``llm.llm_engine.engine_core.shutdown()`` (``InprocClient.shutdown``
  -> ``EngineCore.shutdown``). Dropping the last reference does not release it: every ``LLM`` stays reachable, as
  vLLM's ``gc.freeze()`` at start-up keeps its reference cycles out of the garbage collector until that shutdown
  (``v1/engine/core.py``, ``freeze_gc_heap``); the counters ``live``, ``max_live`` and ``shutdowns`` stand for its
  device memory;
- the shutdown, like vLLM's (``cleanup_dist_env_and_memory`` -> ``destroy_distributed_environment``), destroys
  torch.distributed's default process group if one exists, whoever created it;
- ``autocast_seen`` records whether ``torch.autocast`` was on in the calling thread at each call;
- ``SamplingParams(logprobs=N)`` with truncation returns, per generated token, what vLLM's processed log-probs give
  (``logprobs_mode="processed_logprobs"``): the N most likely tokens with a finite log-prob on the ones the
  truncation kept (the torch engine's recorded set; their values other than the sampled token's are not emulated)
  and -inf on the others, plus the sampled token.
"""

from __future__ import annotations

import importlib.machinery
import os
import random
import types
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


class StandInVLLM(types.ModuleType):
    """The ``vllm`` module; ``started``, ``live``, ``max_live``, ``shutdowns``, ``request_seeds`` and
    ``autocast_seen`` are what it saw."""

    def __init__(self, on_cpu: bool = True) -> None:
        super().__init__("vllm")
        self.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # importlib.util.find_spec finds it
        self.on_cpu = on_cpu
        self.started: list[dict[str, Any]] = []
        self.instances: list[Any] = []  # every LLM ever built stays reachable (vLLM's frozen cycles)
        self.live = 0
        self.max_live = 0
        self.shutdowns = 0
        self.request_seeds: list[int | None] = []
        self.autocast_seen: dict[str, bool] = {}
        self.LLM = _llm_class(self)
        self.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)


def vllm_modules(vllm: StandInVLLM) -> dict[str, ModuleType]:
    """``{"vllm": vllm, "vllm.platforms": ...}`` for ``sys.modules`` (``current_platform.is_cpu()`` is
    ``vllm.on_cpu``)."""
    platforms = types.ModuleType("vllm.platforms")
    platforms.__spec__ = importlib.machinery.ModuleSpec("vllm.platforms", None)
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: vllm.on_cpu)
    vllm.platforms = platforms
    return {"vllm": vllm, "vllm.platforms": platforms}


def set_random_seed(seed: int) -> None:
    """vLLM's ``set_random_seed`` (``vllm/utils/torch_utils.py``), with ``current_platform.manual_seed_all`` =
    ``torch.cuda.manual_seed_all`` (``vllm/platforms/cuda.py``)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu") or (
        torch.cuda.is_available() and torch.is_autocast_enabled("cuda")
    )


def _llm_class(vllm: StandInVLLM) -> type:
    # One piece: the stand-in classes close over the one StandInVLLM they count for; split, they would need it passed.
    class EngineCore:
        def __init__(self, engine: Any) -> None:
            self.engine = engine

        def shutdown(self) -> None:
            if self.engine is None:
                return
            self.engine = None
            vllm.live -= 1
            vllm.shutdowns += 1
            if dist.is_available() and dist.is_initialized():  # cleanup_dist_env_and_memory
                dist.destroy_process_group()

    class LLM:
        def __init__(self, model: str, **kwargs: Any) -> None:
            from transformers import AutoConfig, AutoModelForCausalLM

            from ais_lightning.rollout import TorchRolloutEngine

            # what the worker does to the process when it starts (module docstring)
            torch.set_float32_matmul_precision(os.environ.get("VLLM_FLOAT32_MATMUL_PRECISION", "highest"))
            set_random_seed(int(kwargs.get("seed", 0)))
            vllm.started.append({"model": model, **kwargs})
            vllm.instances.append(self)
            vllm.live += 1
            vllm.max_live = max(vllm.max_live, vllm.live)
            config = AutoConfig.from_pretrained(model)
            engine = TorchRolloutEngine(AutoModelForCausalLM.from_pretrained(model).eval(), precision="fp32")
            self.llm_engine = SimpleNamespace(
                model_config=SimpleNamespace(hf_config=config), engine_core=EngineCore(engine)
            )

        @property
        def _engine(self) -> Any:
            engine = self.llm_engine.engine_core.engine
            if engine is None:
                raise RuntimeError("stand-in vLLM: this LLM was shut down")
            return engine

        def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None:
            vllm.autocast_seen["collective_rpc"] = _autocast_on()
            assert method == "reload_weights" and kwargs["is_checkpoint_format"]
            self._engine.sync_weights(kwargs["weights_iterator"])

        def reset_prefix_cache(self) -> None:
            vllm.autocast_seen["reset_prefix_cache"] = _autocast_on()

        def generate(self, requests: list[dict], params: list[Any], use_tqdm: bool = False) -> list[Any]:
            from ais_lightning.rollout import SamplingConfig

            vllm.autocast_seen["generate"] = _autocast_on()
            torch.randint(0, 2**31, (len(requests),))  # forward_cpu's per-row seeds, unused for seeded rows
            outputs = []
            for request, p in zip(requests, params):
                vllm.request_seeds.append(p.seed)
                seed = p.seed if p.seed is not None else int(np.random.randint(0, 2**31))  # V2's draw
                sampling = SamplingConfig(
                    n=p.n,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=max(p.top_k, 0),
                    min_p=getattr(p, "min_p", 0.0),
                    max_new_tokens=p.max_tokens,
                    stop_token_ids=p.stop_token_ids,
                    seed=seed,
                )
                batch = self._engine.generate([request["prompt_token_ids"]], sampling)
                completions = []
                for i in range(p.n):
                    mask = batch.response_mask[i]
                    ids = batch.response_ids[i][mask].tolist()
                    lps = batch.rollout_logprobs[i][mask].tolist()
                    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)]
                    if p.logprobs and batch.support is not None:
                        _add_top_logprobs(steps, batch.support, i, p.logprobs)
                    completions.append(
                        SimpleNamespace(
                            index=i, token_ids=ids, finish_reason=batch.finish_reason[i], logprobs=steps
                        )
                    )
                outputs.append(SimpleNamespace(outputs=completions))
            return outputs

    return LLM


def _add_top_logprobs(steps: list[dict], support: Any, row: int, n: int) -> None:
    """Add vLLM's top-``n`` processed log-probs to each position's dict: the kept tokens (finite), then -inf."""
    counts, ids = support.counts[row].tolist(), support.ids[row].tolist()
    start = 0
    for step, count in zip(steps, counts):
        kept = ids[start : start + count]
        start += count
        dropped = [t for t in range(n + count) if t not in kept][: max(n - count, 0)]
        for t in kept[:n]:
            step.setdefault(t, SimpleNamespace(logprob=-1.0))
        for t in dropped:
            step.setdefault(t, SimpleNamespace(logprob=float("-inf")))
