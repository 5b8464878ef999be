"""Argument checks shared by the settings dataclasses and components (one message everywhere)."""

from __future__ import annotations

from typing import Any


def check_int(value: Any, name: str, minimum: int = 1) -> None:
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
