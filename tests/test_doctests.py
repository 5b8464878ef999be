"""Every ``>>>`` example in the package runs and prints what it shows (the public classes' ``Example:``s)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import ais_lightning

OPTIONAL = ("vllm", "transformer_engine", "te_engine", "vllm_engine")
"""Modules that need an optional package at import (skipped when it is missing)."""


def modules_with_examples() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(ais_lightning.__path__, prefix="ais_lightning."):
        if ".conf" in info.name:
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            if any(part in info.name for part in OPTIONAL):
                continue
            raise
        if doctest.DocTestFinder().find(module) and any(
            t.examples for t in doctest.DocTestFinder().find(module)
        ):
            names.append(info.name)
    return names


MODULES = modules_with_examples()


def test_the_package_has_examples():
    assert len(MODULES) >= 5, MODULES  # the correctors, metrics, engine and policy carry theirs


@pytest.mark.parametrize("name", MODULES)
def test_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
    )
