"""Config dataclass fields whose values are range-checked when a config is validated.

Light on purpose (no torch): the config schemas of ``plfl.config`` and of every
method (its module in ``plfl.methods``) are built from these, and ``plfl fit`` checks a
config before anything heavy is imported. Every field carries ``doc``, what its key means:
``plfl methods`` and the configuration reference of the documentation print it (:func:`key_rows`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any, Callable, Iterable, Union

import yaml


def documented(default: Any = dataclasses.MISSING, doc: str = "", **kwargs: Any) -> Any:
    """A dataclass field without a range check; ``doc`` says what the key means."""
    return field(default=default, metadata={"doc": doc}, **kwargs)


def checked(
    default: Any, check: Callable[[Any], bool], allowed: Union[str, Callable[[], str]], doc: str = "", **kwargs: Any
) -> Any:
    """A dataclass field whose value must satisfy ``check``; ``allowed`` (or what it returns, when the values
    come from a registry read on demand) is said in the error, ``doc`` (what the key means) in ``plfl methods``."""
    return field(default=default, metadata={"check": check, "allowed": allowed, "doc": doc}, **kwargs)


def one_of(default: str, choices: Union[tuple[str, ...], Callable[[], Iterable[str]]], doc: str = "") -> Any:
    """A string field restricted to ``choices``: a tuple, or a function returning a registry's names (so that
    the registry is imported only when a config is checked)."""
    names = choices if callable(choices) else (lambda: choices)
    return checked(default, lambda v: v in names(), lambda: "one of " + ", ".join(names()), doc)


def allowed(f: dataclasses.Field) -> str:
    """What a checked field's values may be, in words ("" for a field that is not checked)."""
    text = f.metadata.get("allowed", "")
    return text() if callable(text) else text


@dataclasses.dataclass(frozen=True)
class KeyRow:
    """One config key as the reference lists it: dotted ``key``, its ``type`` and ``default`` as written in
    YAML, the ``allowed`` values in words ("" when any value of the type is) and ``doc``, its meaning."""

    key: str
    type: str
    default: str
    allowed: str
    doc: str


def key_rows(schema: type, prefix: str) -> list[KeyRow]:
    """The keys of the dataclass ``schema`` under ``prefix`` (e.g. ``"federation."``), nested dataclasses
    (config sections) expanded in field order; a ``name`` field of a method schema is left to the caller."""
    rows = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            rows += key_rows(type(default), f"{prefix}{f.name}.")
            continue
        rows.append(
            KeyRow(
                f"{prefix}{f.name}", _type_name(hints[f.name]), _yaml(default), allowed(f), f.metadata.get("doc", "")
            )
        )
    return rows


def _type_name(hint: Any) -> str:
    """``Optional[int]`` → "int or null", ``list[int]`` → "list of int"."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is Union:
        return " or ".join(_type_name(a) for a in args) + " or null"
    if typing.get_origin(hint) is list:
        return f"list of {_type_name(args[0])}"
    return {"Any": "mapping"}.get(getattr(hint, "__name__", str(hint)), getattr(hint, "__name__", str(hint)))


def _yaml(value: Any) -> str:
    """``value`` as YAML writes it in a flow: null, true, [head, bn], 0.005."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("\n...").strip()
