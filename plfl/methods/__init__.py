"""Federated learning methods by ``method.name``: every module of this package is the method it is named after
(``plfl/methods/fedavg.py`` is ``method.name=fedavg``), except the building blocks methods share
(:data:`BUILDING_BLOCKS`).

A method is one module: its config (``config_class``, the ``method.*`` keys) beside its class (the
:class:`~plfl.methods.base.Method` subclass whose ``name`` is the module's). The method names come from the module
names, and a method's config class is rebuilt from its module's source (:func:`source_config_class`), without
importing any: a config with a key the method does not have or a value out of its range is refused before torch
is imported. A method's module (and torch with it) is imported when the method is asked for: to list it
(``plfl methods``) or to run it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import pkgutil
import typing
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

from plfl import fields
from plfl.errors import ConfigError

# Modules of this package that are not methods but parts that methods share.
BUILDING_BLOCKS = frozenset({"base", "ala", "partial", "hypernetwork", "prototypes", "clusters"})


def method_names() -> tuple[str, ...]:
    """Every ``method.name``, sorted: the package's modules but its building blocks (none is imported)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in BUILDING_BLOCKS))


def _require_known(name: str) -> None:
    """Raises:
    ConfigError: ``name`` is no method's (the message suggests close ones and lists the valid ones)."""
    names = method_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"Unknown method.name {name!r}.{hint} Valid names: {', '.join(names)}.")


@cache
def method_class(name: str) -> type:
    """The :class:`~plfl.methods.base.Method` subclass of ``method.name`` ``name`` (its module imported now).

    Raises:
        ConfigError: unknown name (the message suggests close ones and lists the valid ones).
    """
    _require_known(name)
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


@cache
def source_config_class(name: str) -> Optional[type]:
    """Method ``name``'s config class rebuilt from the source of this package's modules, none of them imported
    (nor torch): the same fields, types, defaults and range checks (:mod:`plfl.fields`), without the class's own
    functions (a ``__post_init__`` check runs when the method's module is imported). None where the source does
    not say the class plainly: a base class or a name in a field that is neither in :data:`SOURCE_NAMESPACE` nor
    a class or function defined in, or imported by ``from plfl.methods.<module> import``, the module that uses
    it; then only importing the method tells.

    Raises:
        ConfigError: unknown name, as :func:`method_class`.
    """
    _require_known(name)
    method = _find(name, lambda node: isinstance(node, ast.ClassDef) and _assigned(node, "name") == name)
    config = _config_class(method) if method else None
    return _rebuilt(config) if config else None


# What a config class's field may name, besides builtins and the classes and functions of this package.
SOURCE_NAMESPACE = {
    **{name: getattr(typing, name) for name in ("Any", "ClassVar", "Literal", "Optional", "Union")},
    **{name: getattr(fields, name) for name in ("checked", "documented", "one_of")},
    "field": dataclasses.field,
}

# A class or function statement at the top of one of this package's modules, with the module's name.
_Statement = tuple[Union[ast.ClassDef, ast.FunctionDef], str]


@cache
def _module_source(module: str) -> Optional[ast.Module]:
    path = Path(__file__).with_name(f"{module}.py")
    return ast.parse(path.read_text(encoding="utf-8")) if path.is_file() else None


def _find(module: str, match: Any) -> Optional[_Statement]:
    """The first class or function statement at the top of ``module`` for which ``match(node)`` holds."""
    tree = _module_source(module)
    kinds = (ast.ClassDef, ast.FunctionDef)
    found = [n for n in tree.body if isinstance(n, kinds) and match(n)] if tree else []
    return (found[0], module) if found else None


def _resolve(name: str, module: str) -> Optional[_Statement]:
    """The statement that defines ``name`` in ``module``: there, or in a module of this package it imports from."""
    defined = _find(module, lambda node: node.name == name)
    if defined or _module_source(module) is None:
        return defined
    for node in _module_source(module).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{__name__}."):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _resolve(alias.name, node.module.rsplit(".", 1)[1])
    return None


def _assigned(node: ast.ClassDef, attribute: str) -> Optional[Any]:
    """The expression a class statement's body assigns to ``attribute`` (a constant's value), or None."""
    for stmt in node.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == attribute for t in targets) and stmt.value is not None:
            return stmt.value.value if isinstance(stmt.value, ast.Constant) else stmt.value
    return None


def _config_class(method: _Statement) -> Optional[_Statement]:
    """The class a method's ``config_class`` names, its own or inherited."""
    value = _assigned(method[0], "config_class")
    if value is not None:
        return _resolve(value.id, method[1]) if isinstance(value, ast.Name) else None
    for base in method[0].bases:
        found = _resolve(base.id, method[1]) if isinstance(base, ast.Name) else None
        inherited = _config_class(found) if found else None
        if inherited:
            return inherited
    return None


def _namespace(node: ast.AST, module: str) -> dict[str, Any]:
    """:data:`SOURCE_NAMESPACE` and the package's classes and functions that ``node`` names, rebuilt."""
    namespace = dict(SOURCE_NAMESPACE)
    itself = {getattr(node, "name", None)}  # a recursive function names itself
    for name in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - set(namespace) - itself:
        found = _resolve(name, module)
        rebuilt = _rebuilt(found) if found else None
        if rebuilt is not None:
            namespace[name] = rebuilt
    return namespace


@cache
def _rebuilt(statement: _Statement) -> Optional[Any]:
    """The class (a dataclass) or function that ``statement`` defines, what it names rebuilt likewise; None if
    it names anything else (a name missing from its namespace)."""
    node, module = statement

    def evaluate(expression: ast.expr) -> Any:
        return eval(compile(ast.Expression(expression), module, "eval"), _namespace(expression, module))

    try:
        if isinstance(node, ast.FunctionDef):
            namespace = _namespace(node, module)
            exec(compile(ast.Module([node], []), module, "exec"), namespace)
            return namespace[node.name]
        bases = tuple(evaluate(base) for base in node.bases)
        own = []
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                kind = evaluate(stmt.annotation)
                if kind is not ClassVar and typing.get_origin(kind) is not ClassVar:
                    default = evaluate(stmt.value) if stmt.value else dataclasses.MISSING
                    spec = default if isinstance(default, dataclasses.Field) else dataclasses.field(default=default)
                    own.append((stmt.target.id, kind, spec))
    except NameError:  # a name the source does not say plainly (then only importing the module tells)
        return None
    where = {"__module__": f"{__name__}.{module}", "__doc__": ast.get_docstring(node)}
    return dataclasses.make_dataclass(node.name, own, bases=bases, namespace=where)


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


__all__ = [
    "BUILDING_BLOCKS",
    "build_method",
    "method_class",
    "method_names",
    "source_config_class",
    "methods",
    "summary",
    "takes_ala",
]
