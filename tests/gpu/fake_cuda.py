"""A pretend CUDA machine for the CPU tests of config-time GPU checks (not a test module).

``fake_cuda(monkeypatch, capability=(9, 0))`` makes ``torch.cuda`` report GPUs of that compute capability
and ``torch.version.cuda`` a CUDA version, so the engines' ``check_args`` can be exercised on a CPU
machine. Nothing that touches a real device works under it.
"""

from __future__ import annotations

import torch


def fake_cuda(
    monkeypatch,
    capability: tuple[int, int] = (9, 0),
    count: int = 2,
    current: int = 0,
    cuda_version: str = "12.9",
    name: str = "Fake GPU",
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
