"""Config dataclass fields whose values are range-checked when a config is validated.

Light on purpose (no torch): the config schemas of ``plfl.config`` and of every
method (``plfl.methods.schemas``) are built from these, and ``plfl fit`` checks a
config before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Callable, Iterable, Union


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
