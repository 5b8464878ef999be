"""A stand-in ``vllm`` package for CPU tests of the vLLM engine's lifecycle (not a test module).

``stand_in_vllm(monkeypatch)`` puts a ``vllm`` module in ``sys.modules`` whose ``LLM`` generates with the
torch engine (fp32, on the saved model directory the engine hands it) and answers the calls
``VLLMRolloutEngine`` makes: ``collective_rpc("reload_weights", ...)``, ``reset_prefix_cache``, ``generate``
(RequestOutput-like objects with per-token log-probs). It counts live engines, as GPU memory would:

- an ``LLM`` is live from its construction until ``llm.llm_engine.engine_core.shutdown()``, the in-process
  engine core's teardown in vLLM 0.33 (``v1/engine/core_client.py``, ``InprocClient.shutdown`` ->
  ``v1/engine/core.py``, ``EngineCore.shutdown``). Dropping the last reference does not release it: the
  stand-in keeps every ``LLM`` reachable, as vLLM's ``gc.freeze()`` at engine start-up keeps its reference
  cycles out of the garbage collector until that shutdown (``EngineCore.__init__``, ``freeze_gc_heap``);
- the shutdown, like vLLM's (``cleanup_dist_env_and_memory`` -> ``destroy_distributed_environment``),
  destroys torch.distributed's default process group if one exists, whoever created it;
- ``autocast_seen`` records whether ``torch.autocast`` was on in the calling thread at each call;
- ``SamplingParams(logprobs=N)`` with truncation returns, per generated token, what vLLM's processed log-probs give
  (``logprobs_mode="processed_logprobs"``): the N most likely tokens with a finite log-prob on the ones the
  truncation kept (the torch engine's recorded set; their values other than the sampled token's are not emulated)
  and -inf on the others, plus the sampled token.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist


class StandInVLLM(types.ModuleType):
    """The ``vllm`` module; ``started``, ``live``, ``max_live``, ``shutdowns`` and ``autocast_seen`` are counters."""

    def __init__(self) -> None:
        super().__init__("vllm")
        self.started: list[dict[str, Any]] = []
        self.instances: list[Any] = []  # every LLM ever built stays reachable (vLLM's frozen cycles)
        self.live = 0
        self.max_live = 0
        self.shutdowns = 0
        self.autocast_seen: dict[str, bool] = {}
        self.LLM = _llm_class(self)
        self.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu") or (
        torch.cuda.is_available() and torch.is_autocast_enabled("cuda")
    )


def _llm_class(vllm: StandInVLLM) -> type:
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
            outputs = []
            for request, p in zip(requests, params):
                sampling = SamplingConfig(
                    n=p.n,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=max(p.top_k, 0),
                    min_p=getattr(p, "min_p", 0.0),
                    max_new_tokens=p.max_tokens,
                    stop_token_ids=p.stop_token_ids,
                    seed=p.seed,
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


def stand_in_vllm(monkeypatch, on_cpu: bool = True) -> StandInVLLM:
    """Install the stand-in as ``vllm`` (and ``vllm.platforms``) for one test; returns its counters."""
    vllm = StandInVLLM()
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: on_cpu)
    vllm.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    from ais_lightning.rollout import engine_args

    monkeypatch.setattr(engine_args, "has_package", lambda name: True)
    return vllm
