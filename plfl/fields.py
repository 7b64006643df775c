"""Config dataclass fields whose values are range-checked when a config is validated, and the components a
config key chooses by name.

Light on purpose (no torch): the config schemas of ``plfl.config``, of every component (a data source, a
partition, a model, an executor: :class:`Component`) and of every method (its module in ``plfl.methods``) are
built from these, and ``plfl fit`` checks a config before anything heavy is imported. Every field carries
``doc``, what its key means: ``plfl methods`` and the configuration reference of the documentation print it
(:func:`key_rows`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any, Callable, ClassVar, Iterable, TypeVar, Union

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


C = TypeVar("C", bound="Component")


class Component:
    """A part of a run that a config key names (``data.source``, ``data.partition``, ``model.name``,
    ``federation.executor``): a dataclass of the keys it reads, declared beside the code that reads them.

    The subclasses of a family's base class that set ``choice`` (the value of the key that chooses them) are the
    family's registry (:func:`registry`); a config section holds the keys of all of them (:func:`section`), and
    the config refuses a key, set to another value than its default, that the chosen component does not read
    (:func:`readers` names who does).
    """

    choice: ClassVar[str]
    # Key → why this component does not read it, said when a config sets it (e.g. resnet18 and batch_norm).
    notes: ClassVar[dict[str, str]] = {}

    @classmethod
    def of(cls: type[C], section: Any) -> C:
        """This component's keys with their values in ``section`` (a config section that holds them)."""
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})

    def check(self) -> None:
        """Refuse values that each key's range allows but their combination does not (default: none).

        Raises:
            ConfigError: naming the keys and the fix.
        """


def registry(base: type[C]) -> dict[str, type[C]]:
    """``choice`` → class, sorted by choice, of every subclass of ``base`` (at any depth) that sets ``choice``."""
    found, pending = {}, list(base.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "choice" in cls.__dict__:
            found[cls.choice] = cls
    return dict(sorted(found.items()))


def key_names(schema: type) -> frozenset[str]:
    """The names of the keys (fields) of the dataclass ``schema``."""
    return frozenset(f.name for f in dataclasses.fields(schema))


def readers(components: dict[str, type], key: str) -> list[str]:
    """The choices of the ``components`` (choice → class) that read ``key``."""
    return [name for name, cls in components.items() if key in key_names(cls)]


def section(name: str, module: str, common: type, components: Iterable[type], doc: str) -> type:
    """A config section: the dataclass ``name`` with the keys of ``common`` and then every key of ``components``,
    each once, defined as a class of ``module`` (so that it pickles by reference, as ``module.name``).

    Raises:
        TypeError: two components declare a key of the same name apart (share it through a base class).
    """
    declared: dict[str, dataclasses.Field] = {}
    fields = []
    for cls in (common, *components):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in declared:
                if declared[f.name] is not f:
                    raise TypeError(f"{cls.__name__} declares the key {f.name!r} apart from another component")
                continue
            declared[f.name] = f
            kept = field(default=f.default, default_factory=f.default_factory, metadata=f.metadata)
            fields.append((f.name, hints[f.name], kept))
    cls = dataclasses.make_dataclass(name, fields)
    cls.__module__, cls.__qualname__, cls.__doc__ = module, name, doc
    return cls


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value (a new one from its factory)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


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
        default = default_of(f)
        if dataclasses.is_dataclass(default):
            rows += key_rows(type(default), f"{prefix}{f.name}.")
            continue
        rows.append(
            KeyRow(
                f"{prefix}{f.name}", _type_name(hints[f.name]), as_yaml(default), allowed(f), f.metadata.get("doc", "")
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


def as_yaml(value: Any) -> str:
    """``value`` as YAML writes it in a flow: null, true, [head, bn], 0.005."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("\n...").strip()
