"""Engine factories: an engine to build later from a model.

Every engine class validates its own arguments in one classmethod, ``check_args(**kwargs)``
(:meth:`TorchRolloutEngine.check_args`, :meth:`VLLMRolloutEngine.check_args`,
:meth:`TERolloutEngine.check_args`), which its constructor calls too. An :class:`EngineSpec` is an engine class
and its arguments, checked once; :func:`engine_class_of` reads the class and arguments of any engine factory that
shows them. The engines by name: ``ais_lightning.rollout.ENGINES``.
"""

from __future__ import annotations

import functools
from typing import Any

from ais_lightning.rollout.base import RolloutEngine


class EngineSpec(functools.partial):
    """An engine class and its keyword arguments, checked: ``spec(model)`` builds ``engine_class(model, **arguments)``.

    A ``functools.partial`` of a :class:`~ais_lightning.rollout.base.RolloutEngine` subclass (``spec.func``,
    ``spec.keywords``) whose arguments the class's ``check_args`` checks when the spec is made; the result is kept
    (:attr:`checked_arguments`: every argument with the constructor's defaults filled in and normalized) and so is the
    result of every :meth:`check` with other values, so each check runs once however often it is asked for.
    ``ais-train``'s builder hands its engines to the module as specs (``ais_lightning.app.build.Components.engine``).
    ValueError (naming the argument) when ``check_args`` refuses the arguments.

    Example:
        >>> from ais_lightning.rollout import EngineSpec, TorchRolloutEngine
        >>> spec = EngineSpec(TorchRolloutEngine, precision="int8_nested", kv_cache_dtype="auto")
        >>> spec.engine_class.__name__, spec.arguments
        ('TorchRolloutEngine', {'precision': 'int8_nested', 'kv_cache_dtype': 'auto'})
        >>> spec.checked_arguments["kv_cache_dtype"] is None  # "auto" normalized by check_args
        True
        >>> spec.check(precision="int4")["backend"]  # the same engine at another precision
        'emulate'
        >>> spec.same_engine_as(EngineSpec(TorchRolloutEngine, precision="int8_nested"))
        True
    """

    checked_arguments: dict[str, Any]
    """``engine_class.check_args(**arguments)``, run when the spec was made."""

    def __new__(cls, engine_class: type[RolloutEngine], /, **arguments: Any) -> EngineSpec:
        if not (isinstance(engine_class, type) and issubclass(engine_class, RolloutEngine)):
            raise TypeError(f"EngineSpec needs a RolloutEngine subclass, got {engine_class!r}")
        spec = super().__new__(cls, engine_class, **arguments)
        spec._checks = {}
        spec.checked_arguments = spec.check()
        return spec

    def __reduce__(self) -> tuple[Any, ...]:  # copy and pickle without running check_args again
        return _restore_spec, (type(self), self.func, dict(self.keywords), dict(self.__dict__))

    @property
    def engine_class(self) -> type[RolloutEngine]:
        """The engine class built."""
        return self.func

    @property
    def arguments(self) -> dict[str, Any]:
        """The keyword arguments it is built with (as given, not normalized)."""
        return dict(self.keywords)

    def check(self, **overrides: Any) -> dict[str, Any]:
        """``check_args`` of the arguments with ``overrides`` (hashable values, e.g. another ``precision``), run once
        per distinct ``overrides`` and remembered; raises as ``check_args`` does."""
        key = tuple(sorted(overrides.items()))
        if key not in self._checks:
            self._checks[key] = self.func.check_args(**{**self.keywords, **overrides})
        return dict(self._checks[key])

    def same_engine_as(self, other: EngineSpec) -> bool:
        """Whether ``other`` builds the same engine: the same class with the same checked arguments."""
        return other.func is self.func and other.checked_arguments == self.checked_arguments

    @classmethod
    def of(cls, factory: Any) -> EngineSpec | None:
        """``factory`` as a spec: itself if it is one, else a spec of what :func:`engine_class_of` reads from it
        (checked now); None when it does not show its engine class (a lambda, a function)."""
        if isinstance(factory, EngineSpec):
            return factory
        found = engine_class_of(factory)
        return None if found is None else cls(found[0], **found[1])


def _restore_spec(
    cls: type[EngineSpec], engine_class: type, arguments: dict[str, Any], state: dict[str, Any]
) -> EngineSpec:
    spec = functools.partial.__new__(cls, engine_class, **arguments)
    spec.__dict__.update(state)
    return spec


def engine_class_of(factory: Any) -> tuple[type[RolloutEngine], dict[str, Any]] | None:
    """The engine class and keyword arguments ``factory(model)`` builds with, read without calling it: from an
    :class:`EngineSpec` or a ``functools.partial`` of a :class:`~ais_lightning.rollout.base.RolloutEngine` subclass
    with keyword arguments only, or an engine class itself (no arguments); None for any other callable (a lambda, a
    function), whose engine is known only once built.

    Example:
        >>> import functools
        >>> from ais_lightning.rollout import TorchRolloutEngine, engine_class_of
        >>> engine_class_of(functools.partial(TorchRolloutEngine, precision="fp4"))
        (<class 'ais_lightning.rollout.torch_engine.TorchRolloutEngine'>, {'precision': 'fp4'})
        >>> engine_class_of(lambda model: TorchRolloutEngine(model)) is None
        True
    """
    if isinstance(factory, functools.partial):
        func, arguments = factory.func, dict(factory.keywords)
        if factory.args:
            return None
    else:
        func, arguments = factory, {}
    if isinstance(func, type) and issubclass(func, RolloutEngine):
        return func, arguments
    return None


def same_engine(a: Any, b: Any) -> bool:
    """Whether two engine factories build the same engine: the same object, or the same engine class with the same
    arguments after its ``check_args`` (:meth:`EngineSpec.same_engine_as`; an ``EngineSpec``'s checked arguments are
    the ones it was made with, a ``functools.partial``'s are checked now)."""
    if a is b:
        return True
    try:
        spec_a, spec_b = EngineSpec.of(a), EngineSpec.of(b)
    except (TypeError, ValueError):
        return False
    return spec_a is not None and spec_b is not None and spec_a.same_engine_as(spec_b)
