"""Federated learning methods by ``method.name``: every module of this package is the method it is named after
(``plfl/methods/fedavg.py`` is ``method.name=fedavg``), except the building blocks methods share
(:data:`BUILDING_BLOCKS`).

A method is one module: its config (``config_class``, the ``method.*`` keys) beside its class (the
:class:`~plfl.methods.base.Method` subclass whose ``name`` is the module's). The method names come from the module
names, without importing any; a method's module (and torch with it) is imported when the method is asked for:
to check its keys, to list it (``plfl methods``), or to run it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
from functools import cache
from typing import Any

from plfl.errors import ConfigError

# Modules of this package that are not methods but parts that methods share.
BUILDING_BLOCKS = frozenset({"base", "ala", "partial", "hypernetwork"})


def method_names() -> tuple[str, ...]:
    """Every ``method.name``, sorted: the package's modules but its building blocks (none is imported)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in BUILDING_BLOCKS))


@cache
def method_class(name: str) -> type:
    """The :class:`~plfl.methods.base.Method` subclass of ``method.name`` ``name`` (its module imported now).

    Raises:
        ConfigError: unknown name (the message suggests close ones and lists the valid ones).
    """
    names = method_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"Unknown method.name {name!r}.{hint} Valid names: {', '.join(names)}.")
    module = importlib.import_module(f"{__name__}.{name}")
    from plfl.methods.base import Method  # (imported with the module above)

    found = [
        cls
        for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, Method) and cls.__dict__.get("name") == name
    ]
    if len(found) != 1:
        raise TypeError(f"{module.__name__} must define one Method class with name = {name!r}")
    return found[0]


def methods() -> dict[str, type]:
    """``method.name`` → its Method class, for every method of the package (their modules imported now)."""
    return {name: method_class(name) for name in method_names()}


def summary(cls: type) -> str:
    """A method's paper and idea in one line: the first line of its class docstring."""
    return (cls.__doc__ or cls.__name__).strip().splitlines()[0]


def takes_ala(cls: type) -> bool:
    """Whether a method accepts ``method.ala`` (ALA as its local initialisation, FedALA paper, Table 4)."""
    return any(f.name == "ala" for f in dataclasses.fields(cls.config_class))


def build_method(config: Any, context: Any, initial_params: Any) -> Any:
    """The method of ``config`` (its ``method`` section) over ``context``, starting from ``initial_params``;
    with ``method.ala`` set, composed with ALA (:func:`plfl.methods.ala.with_ala`).

    Raises:
        ConfigError: unknown ``method.name``, or options the method refuses for this run.
    """
    cls = method_class(config.name)
    if getattr(config, "ala", None) is not None:
        from plfl.methods.ala import with_ala

        cls = with_ala(cls)
    return cls(config, context, initial_params)


__all__ = ["BUILDING_BLOCKS", "build_method", "method_class", "method_names", "methods", "summary", "takes_ala"]
