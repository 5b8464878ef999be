"""The stand-in ``vllm`` package for one test (not a test module): ``ais_lightning.toolkit.stand_ins.vllm_llm``.

``stand_in_vllm(monkeypatch)`` puts a :class:`~ais_lightning.toolkit.stand_ins.vllm_llm.StandInVLLM` into
``sys.modules`` (and tells the engines' package check that vLLM is installed) until the test ends; returns its
counters.
"""

from __future__ import annotations

import sys

from ais_lightning.toolkit.stand_ins.vllm_llm import StandInVLLM, vllm_modules


def stand_in_vllm(monkeypatch, on_cpu: bool = True) -> StandInVLLM:
    """Install the stand-in as ``vllm`` (and ``vllm.platforms``) for one test; returns its counters."""
    from ais_lightning.rollout import engine_args

    vllm = StandInVLLM(on_cpu)
    for name, module in vllm_modules(vllm).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(engine_args, "has_package", lambda name: True)
    return vllm
