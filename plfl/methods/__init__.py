"""Federated learning methods by ``method.name``: every :class:`~plfl.methods.base.Method` subclass of this
package that names itself (``name``), found in its modules.

A method is one module here: its config (``config_class``, the ``method.*`` keys) beside its class. The
config layer checks ``method.*`` against it, ``plfl methods`` lists it, and a run builds it; importing this
package alone loads no method (and no torch) until one is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from functools import cache
from typing import Any

from plfl.errors import ConfigError


@cache
def methods() -> dict[str, type]:
    """``method.name`` → its Method class, for every method of the package (its modules imported now)."""
    from plfl.methods.base import Method

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    found, pending = {}, list(Method.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "name" in cls.__dict__:
            found[cls.name] = cls
    return dict(sorted(found.items()))


def method_class(name: str) -> type:
    """The :class:`~plfl.methods.base.Method` subclass of ``method.name`` ``name``.

    Raises:
        ConfigError: unknown name (the message lists the valid ones).
    """
    registry = methods()
    if name not in registry:
        raise ConfigError(f"Unknown method.name {name!r}; valid names: {', '.join(registry)}.")
    return registry[name]


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


__all__ = ["build_method", "method_class", "methods", "summary", "takes_ala"]
