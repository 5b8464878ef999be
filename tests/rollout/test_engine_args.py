"""Binding engine arguments to a constructor signature: defaults from the signature only, named errors."""

import pytest

from ais_lightning.rollout import engine_args
from ais_lightning.rollout.engine_args import (
    bind_engine_args,
    check_choice,
    check_pad_token_id,
    require_package,
)


class Plain:
    def __init__(self, model, precision: str = "fp32", *, size: int = 3) -> None: ...


class Open:
    def __init__(self, model, precision: str = "bf16", **extra) -> None: ...


class Required:
    def __init__(self, model, path: str, precision: str = "fp32") -> None: ...


def test_defaults_come_from_the_signature():
    assert bind_engine_args(Plain, {}) == {"precision": "fp32", "size": 3}
    assert bind_engine_args(Plain, {"size": 5}) == {"precision": "fp32", "size": 5}


def test_unknown_names_are_listed_unless_the_signature_takes_extras():
    with pytest.raises(
        ValueError,
        match="^colour, model: not an argument of Plain .*; it accepts \\['precision', 'size'\\]",
    ):
        bind_engine_args(Plain, {"colour": 1, "model": 2})
    assert bind_engine_args(Open, {"seed": 1}) == {"precision": "bf16", "extra": {"seed": 1}}
    assert bind_engine_args(Open, {}) == {"precision": "bf16", "extra": {}}


def test_required_arguments_are_named():
    with pytest.raises(ValueError, match="^path: required by Required"):
        bind_engine_args(Required, {})


def test_choice_and_pad_token_messages_name_argument_and_allowed_values():
    check_choice("E", "precision", "fp8", ("fp8", "int8"))
    with pytest.raises(
        ValueError,
        match="^precision='fp4' is not supported by E; precision must be one of \\['fp8', 'int8'\\]",
    ):
        check_choice("E", "precision", "fp4", ("fp8", "int8"))
    check_pad_token_id("E", None)
    check_pad_token_id("E", 0)
    for bad in (-1, 1.5, True, "0"):
        with pytest.raises(ValueError, match="^pad_token_id must be None or an int >= 0 for E"):
            check_pad_token_id("E", bad)


def test_require_package_names_the_extra(monkeypatch):
    require_package("E", "torch", "torch", "pip install torch")
    monkeypatch.setattr(engine_args, "has_package", lambda name: False)
    with pytest.raises(ValueError, match="E needs Foo, which is not installed: pip install 'x\\[foo\\]'"):
        require_package("E", "foo", "Foo", "pip install 'x[foo]'")
    assert not engine_args.has_package("torch")  # the patched module attribute is what require_package reads
    monkeypatch.undo()
    assert engine_args.has_package("torch") and not engine_args.has_package("surely_not_a_package_xyz")
