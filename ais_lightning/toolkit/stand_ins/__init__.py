"""CPU stand-ins for what the GPU paths call on a GPU, for ``tools/gpu_smoke.py --dry`` and the tests.

Each one follows the published source of the part it stands in for (cited in its module) closely enough for the
checks around it to run on a CPU: :mod:`.cublaslt_gemm` (torch's blockwise ``scaled_mm`` and what cuBLASLt reads),
:mod:`.vllm_llm` (vLLM's in-process ``LLM`` and what its worker does to the process), :mod:`.te_recipes`
(Transformer Engine's recipe classes). None of them says anything about a GPU's numbers: a check that passes on a
stand-in shows that the code around the real part holds together, and what the real part must match.

:func:`installed` puts stand-in modules into ``sys.modules`` for a block and :func:`swapped` one attribute
(``monkeypatch`` does the same in tests).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any


@contextlib.contextmanager
def installed(modules: Mapping[str, ModuleType]) -> Iterator[None]:
    """``sys.modules`` with ``modules`` in place for the block, and as it was afterwards."""
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@contextlib.contextmanager
def swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` for the block, and what it was afterwards."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)
