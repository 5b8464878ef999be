"""A config names code: a wrong kind of ``_target_`` is refused at validation, and ``trusted_targets`` restricts
what a config may call (issue #33, cases 5 and 6).

``corrector._target_=os.getcwd`` used to pass the pre-run check (it builds a string) and fail deep inside
training; ``corrector._target_=os.abort`` aborted the process (Hydra's blocklist stops only ``os.system``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ais_lightning.app.build import validate
from ais_lightning.app.config import compose_train_config
from ais_lightning.correctors import TIS, Corrector
from tests.reliability.runs import SMOKE, train

HERE = __name__
TRUSTED_TARGETS_ENV = "AIS_LIGHTNING_TRUSTED_TARGETS"


def make(*overrides: str):
    return compose_train_config(["output_dir=/tmp/ais-test-unused", *overrides])


def annotated_str() -> str:
    return "not a corrector"


def lying_builder(**kwargs) -> TIS:  # annotated as a corrector, returns something else
    return "not a corrector"  # type: ignore[return-value]


def tis_builder(c_high: float = 2.0) -> TIS:
    return TIS(c_high=c_high)


class NotACorrector:
    def __init__(self, **kwargs) -> None:
        pass


class MyCorrector(TIS):
    """A user's own corrector (a plug-in)."""


# -------------------------------------------------------------------------------- case 5: the right kind
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["corrector=none", "corrector._target_=os.getcwd"],
            "corrector._target_=os.getcwd is a builtin_function",
        ),
        (["corrector=none", f"corrector._target_={HERE}.annotated_str"], "builds a str, not a Corrector"),
        (
            ["corrector=none", f"corrector._target_={HERE}.NotACorrector"],
            "builds a NotACorrector, not a Corrector",
        ),
        (["rollout._target_=os.getcwd"], "rollout._target_=os.getcwd does not build a rollout engine"),
        (
            [f"rollout._target_={HERE}.NotACorrector"],
            "rollout._target_=.*NotACorrector does not build a rollout",
        ),
        (["task._target_=os.getcwd"], "task._target_=os.getcwd is a builtin_function"),
        (
            [f"loss._target_={HERE}.NotACorrector"],
            "loss._target_=.*NotACorrector builds a NotACorrector, not a policy loss",
        ),
        ([f"policy._target_={HERE}.NotACorrector"], "policy._target_=.* not a policy spec"),
        ([f"logger._target_={HERE}.NotACorrector"], "logger._target_=.* not LoggerSettings"),
    ],
)
def test_a_target_of_the_wrong_kind_is_refused_at_validation_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(make(*overrides))


def test_a_function_is_judged_by_its_annotation_and_its_result_and_a_plugin_class_passes():
    with pytest.raises(ValueError, match=r"corrector\._target_=.*lying_builder built a str, not a Corrector"):
        validate(make("corrector=none", f"corrector._target_={HERE}.lying_builder"))
    c = validate(make("corrector=none", f"corrector._target_={HERE}.tis_builder", "+corrector.c_high=3.0"))
    assert isinstance(c.corrector, TIS) and c.corrector.c_high == 3.0
    c = validate(make("corrector=tis", f"corrector._target_={HERE}.MyCorrector"))
    assert isinstance(c.corrector, MyCorrector) and isinstance(c.corrector, Corrector)


def test_os_abort_as_a_target_is_refused_before_it_is_called(monkeypatch):
    def abort() -> None:  # stands in for os.abort, which would end the test process
        raise AssertionError("os.abort was called")

    abort.__annotations__.clear()
    monkeypatch.setattr(os, "abort", abort)
    with pytest.raises(ValueError, match=r"corrector\._target_=os\.abort is a function whose result cannot"):
        validate(make("corrector=none", "corrector._target_=os.abort"))


# ---------------------------------------------------------------------------- case 6: trusted targets
def test_trusted_targets_restrict_every_target_to_the_package_and_named_modules(monkeypatch):
    monkeypatch.delenv(TRUSTED_TARGETS_ENV, raising=False)
    validate(make("trusted_targets=[]"))  # every built-in option is inside ais_lightning
    with pytest.raises(
        ValueError, match=r"corrector\._target_=os\.getcwd is not trusted: trusted_targets allows"
    ):
        validate(make("trusted_targets=[my_pkg]", "corrector=none", "corrector._target_=os.getcwd"))
    with pytest.raises(ValueError, match=rf"corrector\._target_={HERE}\.MyCorrector is not trusted"):
        validate(
            make(
                "trusted_targets=[tests.reliability.other]",
                "corrector=tis",
                f"corrector._target_={HERE}.MyCorrector",
            )
        )
    c = validate(
        make("trusted_targets=[tests.reliability]", "corrector=tis", f"corrector._target_={HERE}.MyCorrector")
    )
    assert isinstance(c.corrector, MyCorrector)
    validate(
        make(
            f"trusted_targets=[{HERE}.MyCorrector]", "corrector=tis", f"corrector._target_={HERE}.MyCorrector"
        )
    )
    with pytest.raises(ValueError, match="is not trusted"):  # a prefix of a name is not its module
        validate(
            make("trusted_targets=[tests.reli]", "corrector=tis", f"corrector._target_={HERE}.MyCorrector")
        )


def test_nested_targets_are_checked_and_the_environment_cannot_be_loosened_by_a_config(monkeypatch):
    from ais_lightning.app.build import check_trusted_targets

    nested = OmegaConf.create({"trusted_targets": ["my_pkg"], "a": {"b": [{"_target_": "os.system"}]}})
    with pytest.raises(ValueError, match=r"a\.b\[0\]\._target_=os\.system is not trusted"):
        check_trusted_targets(nested)
    monkeypatch.setenv(TRUSTED_TARGETS_ENV, "my_pkg, other_pkg")
    with pytest.raises(
        ValueError, match=rf"is not trusted: \${TRUSTED_TARGETS_ENV} allows targets in ais_lightning"
    ):
        validate(make(f"trusted_targets=[{HERE}]", "corrector=tis", f"corrector._target_={HERE}.MyCorrector"))
    validate(make())  # the built-in config passes the environment's restriction


def test_ais_train_with_os_abort_ends_with_an_error_naming_the_key_not_an_abort(tmp_path: Path):
    run = train(
        [*SMOKE, "corrector=none", "corrector._target_=os.abort", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
    )
    assert run.proc.returncode != -signal.SIGABRT, "the process aborted"
    assert run.proc.returncode == 1, run.output[-3000:]
    assert (
        "corrector._target_=os.abort is a builtin_function_or_method whose result cannot be known"
        in run.stderr
    )
