"""Component contracts are declared, not probed: the application reads what an engine, a policy (and its spec), a
loss, a corrector, a task or an algorithm declares on its base class (``RolloutEngine``, ``Policy`` /
``PolicySpec``, ``PolicyLoss``, ``Corrector``, ``Task``, ``GRPOSettings``) by plain attribute access, never by
``getattr(x, "<capability>", default)`` or ``hasattr(x, "<capability>")``, and every built-in component subclasses
its base."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_layers import APPLICATION, PACKAGE

PROBES = ("getattr", "hasattr")

POLICY_ATTRIBUTES = {
    "tokenizer",
    "aligned_quantization",
    "aligned_schedule",
    "router_replay",
    "routing_replay",
    "head_dtype",
    "head_float32",
    "chat_template",
    "logprob_chunk_size",
}
"""What ``Policy.__init__`` sets on every policy (instance attributes, not in the class's namespace)."""
MODULE_ATTRIBUTES = {"engine", "eval_engine", "history", "validation_history", "validation_start", "settings"}
"""What ``GRPOModule.__init__`` sets on every module."""
FACTORY_INTERNALS = {"func", "keywords", "args"}
"""A ``functools.partial``'s parts: an engine factory is read through ``ais_lightning.rollout.engine_class_of``."""


def capability_names() -> set[str]:
    """The public names the components' base classes declare, and the attributes their constructors set."""
    from ais_lightning.correctors import Corrector
    from ais_lightning.losses import PolicyLoss
    from ais_lightning.modules.grpo import GRPOModule, GRPOSettings
    from ais_lightning.policy import Policy, PolicySpec
    from ais_lightning.rollout import RolloutEngine
    from ais_lightning.tasks import Task

    names = POLICY_ATTRIBUTES | MODULE_ATTRIBUTES | FACTORY_INTERNALS
    for base in (RolloutEngine, Policy, PolicySpec, PolicyLoss, Corrector, Task, GRPOSettings, GRPOModule):
        declared = set(vars(base)) | set(vars(base).get("__annotations__", {}))
        names |= {n for n in declared if not n.startswith("_")}
    return names


def application_files() -> list[Path]:
    """The application's modules (``tests.test_layers.APPLICATION``) and the LightningModules (``modules/``)."""
    files = []
    for unit in sorted(APPLICATION | {"modules"}):
        path = PACKAGE.joinpath(*unit.split("."))
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    return files


def probes(source: str, names: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, call)`` of every ``getattr(x, "<name>", ...)`` / ``hasattr(x, "<name>")`` of a name in ``names``."""
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in PROBES
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in names
        ):
            yield node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"


def test_the_application_probes_no_declared_capability():
    names = capability_names()
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {call}"
        for path in application_files()
        for line, call in probes(path.read_text(), names)
    ]
    assert not found, (
        "declare the capability on the component's base class and read it directly:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "snippet",
    [
        'check = getattr(engine_cls, "check_args", None)',
        'check = getattr(getattr(factory, "func", None), "check_model", None)',
        'if not callable(getattr(engine, "set_precision", None)): pass',
        'if hasattr(engine, "calibration_state"): pass',
        'own = getattr(c.loss, "own_correction", None)',
        'family = getattr(c.policy, "MODEL_FAMILY", "autoregressive")',
        'tokenizer = getattr(policy, "tokenizer", None)',
        'check = getattr(c.algorithm, "check_components", None)',
    ],
)
def test_the_lint_catches_a_probe(snippet):
    assert [call for _, call in probes(textwrap.dedent(snippet), capability_names())]


def test_generic_lookups_are_not_probes():
    source = "value = getattr(self, name)\ndtype = getattr(torch, 'float32')\nrun = getattr(logger, 'run_id', None)\n"
    assert not list(probes(source, capability_names()))


def test_every_built_in_component_subclasses_its_base():
    from ais_lightning.correctors import CORRECTORS, Corrector
    from ais_lightning.losses import LOSSES, PolicyLoss
    from ais_lightning.policy import POLICIES, PolicySpec
    from ais_lightning.rollout import ENGINES, RolloutEngine, engine_class

    for name in ENGINES:
        cls = engine_class(name)
        assert issubclass(cls, RolloutEngine) and cls.PRECISIONS, name
        assert cls.SUPPORTS_SET_PRECISION == (cls.set_precision is not RolloutEngine.set_precision), name
    assert all(issubclass(cls, PolicySpec) for cls in POLICIES.values())
    assert all(issubclass(cls, PolicyLoss) for cls in LOSSES.values())
    assert all(issubclass(cls, Corrector) for cls in CORRECTORS.values())


def test_an_engine_that_declares_set_precision_must_implement_it():
    from ais_lightning.rollout import RolloutEngine

    with pytest.raises(TypeError, match="SUPPORTS_SET_PRECISION"):

        class Broken(RolloutEngine):
            SUPPORTS_SET_PRECISION = True

            def sync_weights(self, named_tensors):
                pass

            def generate(self, prompts, sampling):
                pass
