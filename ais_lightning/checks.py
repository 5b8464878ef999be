"""Argument checks shared by the settings dataclasses and components (one message everywhere)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def check_int(value: Any, name: str, minimum: int = 1) -> None:
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def registered(registry: Mapping[str, T], name: Any, kind: str) -> T:
    """``registry[name]`` (a package's registry, e.g. ``CORRECTORS``); ValueError naming the ``kind`` and every
    registered name when ``name`` is not one of them."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; registered: {sorted(registry)}")
    return registry[name]
