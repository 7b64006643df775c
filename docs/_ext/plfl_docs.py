"""Pages of the documentation that are generated at build time, so that they cannot drift from the code:

- ``reference/configuration.md``: every config key from the schemas (:func:`plfl.fields.key_rows`, the source
  that ``plfl methods`` prints);
- ``reference/methods/<name>.md``: one page per registered method, from the registry, its config schema and
  its docstrings;
- ``reference/cli.md``: the help of every ``plfl`` command, from the argument parser;
- ``results/<slug>.md``: each measured table ``results/<slug>.csv`` with its ``<slug>.yaml`` (the fields of
  :data:`RESULT_FIELDS`: title, description, command, hardware, software, date, the commit and plfl version it
  was measured with, its data set, units, plot, where it holds accuracies) as a table and a plotly figure, the
  commit and version at the top;
- ``results/dataset-<name>.md``: one overview per data set of :data:`DATASETS` that a table names: a leaderboard
  of the methods' accuracies in that data set's tables, each number linked to its table, then its tables;
- ``results/index.md``: the data sets, every table, and the fields of a results YAML.

A Sphinx extension: the pages are written when the builder starts, before Sphinx reads the sources.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import re
import shutil
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXECUTORS_TEXT = "sequential, vectorized and ray, with the same numbers ([executors](../../explanation/executors.md))"
SECTIONS = {
    "": "Run",
    "data.": "Data (`data.*`)",
    "model.": "Model (`model.*`)",
    "federation.": "Federation (`federation.*`)",
    "eval.": "Evaluation of unseen clients (`eval.*`)",
    "aggregation.": "Robust aggregation (`aggregation.*`)",
    "attack.": "Poisoned clients (`attack.*`)",
    "privacy.": "Differential privacy (`privacy.*`)",
    "logger.": "Logging (`logger.*`)",
    "trainer.": "Lightning Trainer (`trainer.*`)",
    "vectorized.": "Vectorized executor (`vectorized.*`)",
    "ray.": "Ray executor (`ray.*`)",
}
# A results YAML's fields: name -> (required, meaning). read_result checks them; the results index lists them.
RESULT_FIELDS = {
    "title": (True, "what was measured, on what: the page's title"),
    "description": (True, "the setting, what each column holds and how to read it (Markdown; `$...$` is math)"),
    "command": (True, "the command or commands that produced the numbers"),
    "hardware": (True, "the machine: CPU or GPU, cores, torch threads, what else ran on it"),
    "software": (True, "the versions that matter: Python, torch, Lightning, a reference code's commit"),
    "date": (True, "the day the numbers were measured, YYYY-MM-DD (rows measured later: their date in parentheses)"),
    "code": (
        True,
        "the commit whose code measured the numbers, 7 hex digits: the commit at which they were first recorded in "
        "the repository (`git rev-parse --short HEAD` at the measurement, or the commit that records them together "
        "with the change they measure); rows measured at a later commit name it in parentheses, as `date` does",
    ),
    "version": (True, "`plfl.__version__` at that commit (`plfl --version`)"),
    "dataset": (True, "the data set the numbers come from, one of those below, or a list of them; null for none"),
    "units": (False, "column: unit; every accuracy column is in %"),
    "plot": (False, "a figure: `kind` (line, bar), `x`, `y` (a column or a list), `group`, `y_title`, `log_y`"),
    "accuracy": (
        False,
        "where the table holds plfl's test accuracies (%) for the data set's leaderboard: `method` (the column "
        "naming the method) or `methods` ({column: method}, a column per method); `round` (a column, or one round "
        "for every row) or `rounds` ({column: round}, a column per round, with `method`); `value` (the accuracy "
        "column, with `method` and `round`); optional `setting` (another federation of the same data set, ranked "
        "apart), `note` (beside each number; `{column}` is the row's value) and `labels` ({name in the CSV: name "
        "on the leaderboard})",
    ),
}
# The data sets of the results: name -> (title, what the federation is). A results YAML's `dataset` names them.
DATASETS = {
    "mnist": (
        "MNIST Dir(0.1)",
        "MNIST's 70,000 digits over 20 clients with a Dirichlet($\\beta = 0.1$) label skew and a 75/25 "
        "train/test split per client: the FedALA reference repository's own files, which `configs/fedala.yaml` "
        "and most methods' configs read, with the 4-layer CNN unless a table says otherwise.",
    ),
    "mnist-1000-clients": (
        "MNIST, 1000 clients",
        "MNIST over 1000 clients of 2 digits each, a tenth of them training each round "
        "(`configs/fedavg-mnist1000.yaml`): plfl's memory with many clients.",
    ),
    "mnist-fedprox": (
        "MNIST, FedProx's federation",
        "MNIST's 70,000 digits over 1000 clients of 2 consecutive classes each with power-law sample counts and a "
        "90/10 split per client (`data.partition: fedprox`), multinomial logistic regression, a tenth of the "
        "clients per round: Self-FL's MNIST setting (`configs/selffl-mnist.yaml`).",
    ),
    "cifar10-pfedme": (
        "CIFAR-10, pFedMe's federation",
        "CIFAR-10's 60,000 images over 20 clients of 3 consecutive classes each with power-law sample counts "
        "(`data.partition: fedprox`), 5 clients per round, PyTorch's tutorial CNN: Self-FL's CIFAR-10 setting "
        "(`configs/selffl-cifar10.yaml`).",
    ),
    "digits": (
        "digits",
        "scikit-learn's bundled 8×8 digits (1,797 images, 10 classes): the tests' 5-client federation, and "
        "pFedLA's Fig.-5 federation of 8 clients of 4 classes.",
    ),
    "cifar10": (
        "CIFAR-10",
        "CIFAR-10's 60,000 images as JPEG class folders (`data.source: imagefolder`), over 20 clients with a "
        "Dirichlet($\\beta = 0.1$) label skew (`configs/fedala-cifar10.yaml`).",
    ),
    "femnist": (
        "FEMNIST",
        "The 51 writers of LEAF's non-IID FEMNIST sample: 62 classes, each writer's own handwriting, LEAF's 90/10 "
        "split per writer (`configs/selffl-femnist.yaml`, `configs/selffl-femnist-cnn.yaml`, "
        "`configs/fedavg-femnist.yaml`).",
    ),
    "agnews": (
        "AG News",
        "AG News over 20 clients with a Dirichlet($\\beta = 0.1$) label skew and fastText "
        "(`configs/fedala-agnews.yaml`).",
    ),
    "shakespeare": (
        "Shakespeare",
        "LEAF's next-character task built from tiny Shakespeare: the 36 speaking roles with at least 10,000 "
        "characters, LEAF's LSTM (`configs/fedavg-shakespeare.yaml`).",
    ),
    "fmnist": (
        "Fashion-MNIST",
        "Fashion-MNIST over 10 clients in pFedLA's two settings: non-IID_1 (each client holds 4 random classes) "
        "and non-IID_2 (every class on every client, 2 of them with 80 % of their samples) "
        "(`configs/pfedla-fmnist-noniid1.yaml`, `configs/pfedla-fmnist-noniid2.yaml`).",
    ),
}


def cell(text: Any) -> str:
    """``text`` safe inside a Markdown table cell; a ``$`` outside a code span stays a dollar, never starts math."""
    parts = re.split(r"(`[^`]*`)", str(text).replace("|", "\\|").replace("<", "&lt;").replace("\n", " "))
    return "".join(p if p.startswith("`") else p.replace("$", "\\$") for p in parts)


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def key_table(rows: list, read_by: Any = None) -> str:
    """Config keys as a table: key, type, default, allowed values, meaning; with ``read_by`` (key → text), also
    which choices read each key."""
    if read_by is None:
        return table(
            ["key", "type", "default", "allowed", "meaning"],
            [[f"`{r.key}`", r.type, f"`{r.default}`", r.allowed, r.doc] for r in rows],
        )
    return table(
        ["key", "read by", "type", "default", "allowed", "meaning"],
        [[f"`{r.key}`", read_by(r.key), r.type, f"`{r.default}`", r.allowed, r.doc] for r in rows],
    )


def reader_text(key: str) -> str:
    """Which data sources, partitions or models read a ``data.*`` or ``model.*`` key, declared beside them."""
    from plfl.data.partition import partitions
    from plfl.data.sources import data_sources
    from plfl.fields import readers
    from plfl.models import models

    section, name = key.split(".", 1)
    families = {"data": [("source", data_sources()), ("partition", partitions())], "model": [("name", models())]}
    for choice, components in families[section]:
        who = readers(components, name)
        if 0 < len(who) < len(components):
            return ", ".join(f"`{section}.{choice}={w}`" for w in who)
        if who:
            return f"every `{section}.{choice}`"
    return "every source" if section == "data" else "every model"


def configuration_page() -> str:
    from plfl.config import ExperimentConfig
    from plfl.fields import key_rows
    from plfl.methods import methods
    from plfl.methods.ala import ALAConfig
    from plfl.methods.base import MethodConfig

    rows = [r for r in key_rows(ExperimentConfig, "") if r.key != "method"]
    text = [
        "# Configuration\n",
        "Every key a config file or a `key=value` override may set, generated from plfl's config schema "
        "(the dataclasses of `plfl/config.py` and of each method's module). A config is checked against "
        "it before anything trains: an unknown key names the close matches, a wrong type or a value outside "
        "*allowed* names the key and what is allowed, and a key that the chosen source, partition, model or "
        "executor does not read (*read by*, declared beside the code that reads it) is refused unless it holds "
        "its default. `method=NAME` and `model=NAME` on the command line replace the section with NAME's "
        "defaults.\n",
    ]
    for prefix, title in SECTIONS.items():
        section = [r for r in rows if r.key.startswith(prefix) and (prefix or "." not in r.key)]
        read_by = reader_text if prefix in ("data.", "model.") else None
        text += [f"## {title}\n", key_table(section, read_by)]
    text.append(
        "## Methods (`method.*`)\n\n`method.name` picks the method; its own keys sit beside it. `plfl methods "
        "[NAME]` prints the same.\n"
    )
    (name_row,) = [r for r in key_rows(MethodConfig, "method.")]
    text.append(key_table([dataclasses.replace(name_row, allowed="one of " + ", ".join(methods()))]))
    text += [
        "### `method.ala`\n\n[ALA](methods/ala.md) as the local initialisation of a method whose keys list "
        "`method.ala` (FedALA's own keys are the same, directly under `method`).\n",
        key_table(key_rows(ALAConfig, "method.ala.")),
    ]
    for name, cls in methods().items():
        keys = [r for r in key_rows(cls.config_class, "method.") if r.key != "method.name"]
        text.append(f"### `{name}`\n\n[{summary(cls)}](methods/{name}.md)\n")
        text.append(key_table(keys) if keys else "No keys of its own.\n")
    return "\n".join(text)


def summary(cls: type) -> str:
    from plfl.methods import summary as method_summary

    return method_summary(cls)


def files_naming(name: str, folder: str, pattern: str) -> list[str]:
    """Repository files under ``folder`` whose text names ``method.name`` ``name`` (configs, sweeps)."""
    found = []
    for path in sorted((ROOT / folder).glob(pattern)):
        text = yaml.safe_load(path.read_text()) or {}
        method = (text.get("method") or {}).get("name") if isinstance(text.get("method"), dict) else None
        if method == name or (folder == "sweeps" and f"configs/{name}" in path.read_text()):
            found.append(f"`{folder}/{path.name}`")
    return found


def method_page(name: str, cls: type) -> str:
    from plfl.fields import key_rows
    from plfl.methods import takes_ala

    keys = [r for r in key_rows(cls.config_class, "method.") if r.key != "method.name"]
    if name == "fedala":
        ala = "built in: [ALA](ala.md) is FedALA's local initialisation"
    elif takes_ala(cls):
        ala = "yes: `method.ala: {s: 80, p: 2, ...}` adds [ALA](ala.md) to its local initialisation (FedALA, Table 4)"
    else:
        ala = "no: it has a local initialisation of its own, so `method.ala` is an unknown key"
    facts = [
        ["`method.name`", f"`{name}`"],
        ["class", f"{{py:class}}`{cls.__module__}.{cls.__qualname__}`"],
        ["ALA (`method.ala`)", ala],
        ["executors", EXECUTORS_TEXT],
        ["configs", ", ".join(files_naming(name, "configs", "*.yaml")) or "–"],
        ["sweeps", ", ".join(files_naming(name, "sweeps", "*.yaml")) or "–"],
    ]
    return "\n".join(
        [
            f"# {summary(cls).split(':')[0].split(' (')[0]} (`{name}`)\n",
            f"{summary(cls)}\n",
            table(["", ""], facts),
            "## Keys\n",
            key_table(keys) if keys else "No keys of its own; `federation.*` sets its local training.\n",
            "## The method\n",
            "The module's description: the paper, its equations and which hook implements each, and every "
            "departure from the paper or its reference code.\n",
            f"```{{eval-rst}}\n.. automodule:: {cls.__module__}\n   :no-index:\n```\n",
            f"```{{eval-rst}}\n.. autoclass:: {cls.__module__}.{cls.__qualname__}\n"
            "   :members:\n   :exclude-members: config_class, name, server_state\n```\n",
        ]
    )


def ala_page() -> str:
    from plfl.fields import key_rows
    from plfl.methods import methods, takes_ala
    from plfl.methods.ala import ALAConfig

    takers = ", ".join(f"[{n}]({n}.md)" for n, c in methods().items() if takes_ala(c))
    return "\n".join(
        [
            "# Adaptive Local Aggregation (ALA)\n",
            "FedALA's local initialisation as a component: [FedALA](fedala.md) is FedAvg with it (its keys sit "
            f"directly under `method`), and `method.ala: {{...}}` adds it to {takers}.\n",
            "## Keys\n",
            key_table(key_rows(ALAConfig, "method.ala.")),
            "```{eval-rst}\n.. automodule:: plfl.methods.ala\n   :no-index:\n```\n",
        ]
    )


def methods_index() -> str:
    from plfl.methods import methods, takes_ala

    rows = [
        [f"[`{n}`]({n}.md)", summary(c), "built in" if n == "fedala" else "yes" if takes_ala(c) else "no"]
        for n, c in methods().items()
    ]
    toctree = "\n".join([*methods(), "ala"])
    return (
        "# Methods\n\nEvery `method.name`, generated from plfl's method registry: the method's paper and idea, "
        "its keys with their defaults, whether ALA can be added (`method.ala`), and its description with the "
        "equations it implements and its departures from the paper.\n\n"
        + table(["method.name", "method", "[ALA](ala.md)"], rows)
        + f"\n```{{toctree}}\n:hidden:\n\n{toctree}\n```\n"
    )


def cli_page() -> str:
    from plfl.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps its help to the terminal's width
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    text = ["# Command line\n", "The `plfl` command and its subcommands, as `--help` prints them.\n"]
    for name, sub in [("plfl", parser), *((f"plfl {n}", p) for n, p in commands.items())]:
        text += [f"## `{name}`\n", f"```text\n{sub.format_help().rstrip()}\n```\n"]
    return "\n".join(text)


def read_result(meta_path: Path) -> tuple[dict, list[dict[str, str]]]:
    """A results table: its YAML (checked against :data:`RESULT_FIELDS`) and its CSV rows.

    Raises:
        ValueError: a field missing, unknown or malformed (``code``, ``version``, ``dataset``, ``accuracy``), the
            CSV missing, or a column that ``plot`` or ``accuracy`` names not in it.
    """
    meta = yaml.safe_load(meta_path.read_text())
    required = {key for key, (needed, _) in RESULT_FIELDS.items() if needed}
    missing, unknown = required - set(meta), set(meta) - set(RESULT_FIELDS)
    if missing or unknown:
        raise ValueError(f"{meta_path}: missing keys {sorted(missing)}, unknown {sorted(unknown)}")
    if not re.fullmatch(r"[0-9a-f]{7,40}( \(.+\))?", str(meta["code"])):
        raise ValueError(f"{meta_path}: code {meta['code']!r} is not a commit (7 hex digits), with an optional (note)")
    if not re.fullmatch(r"\d+\.\d+\.\d+\S*", str(meta["version"])):
        raise ValueError(f"{meta_path}: version {meta['version']!r} is not a plfl version such as 0.2.0")
    unknown_sets = [d for d in datasets_of(meta) if d not in DATASETS]
    if unknown_sets:
        raise ValueError(f"{meta_path}: dataset {unknown_sets} is none of {', '.join(DATASETS)} (or null)")
    with open(meta_path.with_suffix(".csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    plot = meta.get("plot") or {}
    wanted = [plot.get("x"), plot.get("group"), *as_list(plot.get("y"))]
    absent = [c for c in wanted if c and c not in rows[0]]
    if absent:
        raise ValueError(f"{meta_path}: plot columns {absent} are not in {meta_path.with_suffix('.csv').name}")
    if meta.get("accuracy") is not None:
        check_accuracy(meta_path, meta, rows)
    return meta, rows


def datasets_of(meta: dict) -> list[str]:
    """The data sets a results YAML names (``dataset``: one, a list, or null for none)."""
    return as_list(meta.get("dataset"))


def check_accuracy(meta_path: Path, meta: dict, rows: list[dict[str, str]]) -> None:
    """Raise ValueError unless ``meta["accuracy"]`` is one of the shapes :data:`RESULT_FIELDS` describes."""
    spec, units = meta["accuracy"], meta.get("units") or {}
    unknown = set(spec) - {"method", "methods", "round", "rounds", "value", "setting", "note", "labels"}
    by_column = {"method": "methods" in spec, "round": "rounds" in spec}
    problems = [f"unknown keys {sorted(unknown)}"] if unknown else []
    if ("method" in spec) == by_column["method"] or ("round" in spec) == by_column["round"]:
        problems.append("it needs one of method and methods, and one of round and rounds")
    if by_column["method"] and by_column["round"]:
        problems.append("methods and rounds together leave no column for the value")
    if ("value" in spec) != ("method" in spec and "round" in spec):
        problems.append("value is needed with method and round, and only then")
    if len(datasets_of(meta)) != 1:
        problems.append("the table must name exactly one data set")
    if problems:
        raise ValueError(f"{meta_path}: accuracy: {'; '.join(problems)}")
    columns = [spec.get("method"), spec.get("value"), *spec.get("methods", {}), *spec.get("rounds", {})]
    columns += [spec["round"]] if isinstance(spec.get("round"), str) else []
    absent = [c for c in columns if c is not None and c not in rows[0]]
    if absent:
        raise ValueError(f"{meta_path}: accuracy columns {absent} are not in {meta_path.with_suffix('.csv').name}")
    valued = [spec["value"]] if "value" in spec else [*spec.get("methods", {}), *spec.get("rounds", {})]
    not_percent = [c for c in valued if units.get(c) != "%"]
    if not_percent:
        raise ValueError(f"{meta_path}: accuracy columns {not_percent} must have the unit % in units")


@dataclasses.dataclass(frozen=True)
class Accuracy:
    """One accuracy of a leaderboard: a method's test accuracy (%) at a round, in one results table."""

    method: str  # as the leaderboard shows it
    round: int
    value: str  # the CSV cell, as written
    note: str
    setting: str
    slug: str  # the table's page
    meta: dict = dataclasses.field(compare=False, repr=False)


def accuracies(slug: str, meta: dict, rows: list[dict[str, str]]) -> list[Accuracy]:
    """The accuracies that ``meta["accuracy"]`` points at in ``rows`` (empty cells left out)."""
    spec = meta.get("accuracy")
    if not spec:
        return []
    labels = spec.get("labels") or {}
    found = []
    for row in rows:
        if "methods" in spec:  # one column per method, the round from a column or fixed
            cells = [(name, column, spec["round"]) for column, name in spec["methods"].items()]
        elif "rounds" in spec:  # one column per round, the method from a column
            cells = [(row[spec["method"]], column, r) for column, r in spec["rounds"].items()]
        else:
            cells = [(row[spec["method"]], spec["value"], spec["round"])]
        for name, column, at in cells:
            if row[column].strip():
                found.append(
                    Accuracy(
                        method=str(labels.get(name, name)),
                        round=int(row[at]) if isinstance(at, str) else int(at),
                        value=row[column].strip(),
                        note=str(spec.get("note", "")).format(**row),
                        setting=str(spec.get("setting", "")),
                        slug=slug,
                        meta=meta,
                    )
                )
    return found


def method_key(label: str) -> str:
    """What identifies a method across tables: its label without a trailing "(...)", letters and digits only."""
    return re.sub(r"[^a-z0-9]", "", re.sub(r"\s*\(.*\)\s*$", "", label).lower())


def commit(code: str) -> str:
    """The commit of a results YAML's ``code`` (its first word)."""
    return str(code).split()[0]


def leaderboards(entries: list[Accuracy]) -> dict[tuple[str, int], list[tuple[Accuracy, list[Accuracy]]]]:
    """(setting, round) → the leaderboard at that round: (shown, also measured) per method, best first.

    The rounds are those where some table's run of a method ends. A method measured at a round in several tables
    shows the newest table's number (on a tie, the table whose run ends there), the others as "also"."""
    last = {}
    for e in entries:
        last[e.slug, e.method] = max(last.get((e.slug, e.method), e.round), e.round)
    boards = {}
    for setting, at in sorted({(e.setting, last[e.slug, e.method]) for e in entries}, key=lambda k: (k[0], -k[1])):
        groups: dict[str, list[Accuracy]] = {}
        for e in entries:
            if e.setting == setting and e.round == at:
                groups.setdefault(method_key(e.method), []).append(e)
        board = []
        for group in groups.values():
            group.sort(key=lambda e: (str(e.meta["date"])[:10], last[e.slug, e.method] == at, e.slug), reverse=True)
            board.append((group[0], group[1:]))
        board.sort(key=lambda shown: -float(shown[0].value))
        boards[setting, at] = board
    return boards


def method_link(label: str) -> str:
    """The method's label, linked to the reference page of the registered method it names (``FedProx-C``) or
    is a variant of (``PartialFed-Fix``, ``FedAvg with BatchNorm``: the longest name it starts with)."""
    from plfl.methods import methods

    key = method_key(label)
    names = [n for n in methods() if method_key(n) == key] or sorted(
        (n for n in methods() if key.startswith(method_key(n))), key=len, reverse=True
    )
    return f"[{cell(label)}](../reference/methods/{names[0]}.md)" if names else cell(label)


def leaderboard_table(board: list[tuple[Accuracy, list[Accuracy]]]) -> str:
    """One leaderboard as a Markdown table: rank, method, the number linked to its table, date, code, the others."""
    rows = []
    for rank, (e, also) in enumerate(board, 1):
        value = f"[{e.value}]({e.slug}.md)" + (f" ({cell(e.note)})" if e.note else "")
        others = "; ".join(
            f"[{a.value}]({a.slug}.md)"
            + (f" {cell(a.method)}" if a.method != e.method else "")
            + f" ({a.meta['date']}{', ' + cell(a.note) if a.note else ''})"
            for a in also
        )
        rows.append([rank, method_link(e.method), value, e.meta["date"], f"`{commit(e.meta['code'])}`", others])
    lines = ["| # | method | accuracy (%) | date | code | also measured |", "|" + " --- |" * 6]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]) + "\n"


def overview_page(dataset: str, results: dict[str, tuple[dict, list[dict[str, str]]]]) -> str:
    """The results overview of one data set: its leaderboards, then its tables."""
    title, description = DATASETS[dataset]
    mine = {slug: meta for slug, (meta, _) in results.items() if dataset in datasets_of(meta)}
    entries = [a for slug in mine for a in accuracies(slug, *results[slug])]
    text = [f"# Results on {title}\n", description + "\n"]
    if entries:
        text.append(
            "## Leaderboard\n\nThe test accuracy (%) of each method in this data set's tables, highest first, at "
            "each round where a table's run of a method ends. Each number links to the table it comes from, "
            "beside that table's date and the commit of the code it was measured with (`code`); where several "
            "tables measured a method at that round, the newest one's number is shown and the others are listed "
            "under *also measured*; n = k beside a number: the mean of k runs. The rows come from different runs, "
            "and some from other settings (another model, another learning rate, older code): each table's page "
            "says which.\n"
        )
        for (setting, at), board in leaderboards(entries).items():
            text += [f"### {setting + ', round' if setting else 'Round'} {at}\n", leaderboard_table(board)]
    listing = sorted(mine.items(), key=lambda item: (str(item[1]["date"]), item[0]), reverse=True)
    text += [
        "## Tables\n",
        table(
            ["table", "date", "plfl", "code"],
            [[f"[{m['title']}]({slug}.md)", m["date"], m["version"], f"`{commit(m['code'])}`"] for slug, m in listing],
        ),
    ]
    return "\n".join(text)


def result_page(meta: dict, rows: list[dict[str, str]], csv_name: str) -> str:
    units = meta.get("units") or {}
    header = [f"{c} ({units[c]})" if c in units else c for c in rows[0]]
    code = re.sub(r"\b[0-9a-f]{7,40}\b", r"`\g<0>`", str(meta["code"]))
    sets = ", ".join(f"[{DATASETS[d][0]}](dataset-{d}.md)" for d in datasets_of(meta)) or "none"
    text = [
        f"# {meta['title']}\n",
        f":::{{admonition}} Measured with\n:class: note\n\nplfl {meta['version']}, commit {code}, on {meta['date']} "
        f"(`git checkout {commit(meta['code'])}` gives that code). Data set: {sets}.\n:::\n",
        meta["description"].strip() + "\n",
        table(["", ""], [[k, meta[k]] for k in ("hardware", "software")]),
        f"Command:\n\n```bash\n{meta['command'].strip()}\n```\n",
    ]
    if meta.get("plot"):
        text.append(
            f'```{{raw}} html\n<script src="../_static/plotly.min.js"></script>\n{figure_html(meta, rows)}\n```\n'
        )
    text += [table(header, [list(r.values()) for r in rows]), f"Data: {{download}}`{csv_name} <{csv_name}>`\n"]
    return "\n".join(text)


def fields_section() -> str:
    """The results YAML's fields, for the results index (from :data:`RESULT_FIELDS`)."""
    rows = [[f"`{key}`", "yes" if needed else "no", doc] for key, (needed, doc) in RESULT_FIELDS.items()]
    known = ", ".join(f"`{slug}` ({title})" for slug, (title, _) in DATASETS.items())
    return (
        "## Adding a measurement\n\nA measurement is a CSV file, `docs/results/<name>.csv`, with a YAML file "
        "beside it, `<name>.yaml`, that holds these fields:\n\n"
        + table(["field", "required", "meaning"], rows)
        + f"\nThe data sets: {known}.\n"
    )


def results_pages(folder: Path) -> dict[str, str]:
    """page name → page text for every ``<slug>.yaml`` in ``folder``, one overview ``dataset-<data set>`` per
    data set that a table names, and ``index``.

    Raises:
        ValueError: a YAML that :func:`read_result` refuses, or a table named like an overview page.
    """
    results = {path.stem: read_result(path) for path in sorted(folder.glob("*.yaml"))}
    pages = {slug: result_page(meta, rows, f"{slug}.csv") for slug, (meta, rows) in results.items()}
    named = [d for d in DATASETS if any(d in datasets_of(meta) for meta, _ in results.values())]
    for dataset in named:
        if f"dataset-{dataset}" in pages:
            raise ValueError(f"{folder}/dataset-{dataset}.yaml: the name is the data set's overview page's")
        pages[f"dataset-{dataset}"] = overview_page(dataset, results)
    index = sorted(results.items(), key=lambda item: (str(item[1][0]["date"]), item[0]), reverse=True)
    counts = {d: sum(d in datasets_of(meta) for meta, _ in results.values()) for d in named}
    sets = [f"- [{DATASETS[d][0]}](dataset-{d}.md): {n} table{'s' * (n > 1)}" for d, n in counts.items()]
    pages["index"] = (
        "# Results\n\nMeasured figures, each with the command that produced it, the hardware, the date and the "
        "commit of the code it was measured with. Every page is generated from a CSV file and a YAML file in "
        "`docs/results/`; add a measurement by adding such a pair (below).\n\n"
        "## By data set\n\nEach data set's page ranks the methods by the accuracies its tables hold and lists "
        "its tables.\n\n"
        + "\n".join(sets)
        + "\n\n## All tables\n\n"
        + table(
            ["table", "date", "plfl", "code", "hardware"],
            [
                [f"[{m['title']}]({slug}.md)", m["date"], m["version"], f"`{commit(m['code'])}`", m["hardware"]]
                for slug, (m, _) in index
            ],
        )
        + "\n"
        + fields_section()
        + "\n```{toctree}\n:hidden:\n\n"
        + "\n".join([*(f"dataset-{d}" for d in named), *results])
        + "\n```\n"
    )
    return pages


def as_list(value: Any) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


def number(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def figure_html(meta: dict, rows: list[dict[str, str]]) -> str:
    """The plot the YAML asks for, as a plotly ``div`` (plotly.js is loaded by the page)."""
    import plotly.graph_objects as go

    plot, units = meta["plot"], meta.get("units") or {}
    x, ys, group = plot["x"], as_list(plot["y"]), plot.get("group")
    series = (
        {g: [r for r in rows if r[group] == g] for g in dict.fromkeys(r[group] for r in rows)}
        if group
        else {y: rows for y in ys}
    )
    fig = go.Figure()
    for label, points in series.items():
        y = ys[0] if group else label
        values = [number(r[y]) for r in points]
        xs = [r[x] for r in points]
        if all(number(v) is not None for v in xs):  # a numeric axis (rounds), not categories
            xs = [number(v) for v in xs]
        trace = go.Bar if plot.get("kind") == "bar" else go.Scatter
        fig.add_trace(trace(x=xs, y=values, name=str(label), **({} if trace is go.Bar else {"mode": "lines+markers"})))
    unit = units.get(ys[0], "")
    fig.update_layout(
        template="plotly_white",
        height=420,
        margin=dict(l=60, r=20, t=30, b=50),
        xaxis_title=f"{x} ({units[x]})" if x in units else x,
        yaxis_title=plot.get("y_title") or (f"{ys[0]} ({unit})" if unit else ys[0]),
        yaxis_type="log" if plot.get("log_y") else None,
        barmode="group",
    )
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def write(path: Path, text: str) -> None:
    """Write ``text`` unless the file already holds it (so that Sphinx rebuilds only what changed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def generate(docs: Path = DOCS) -> None:
    """Write every generated page under ``docs``."""
    from plfl.methods import methods

    write(docs / "reference" / "configuration.md", configuration_page())
    with redirect_stdout(io.StringIO()):
        write(docs / "reference" / "cli.md", cli_page())
    write(docs / "reference" / "methods" / "index.md", methods_index())
    write(docs / "reference" / "methods" / "ala.md", ala_page())
    for name, cls in methods().items():
        write(docs / "reference" / "methods" / f"{name}.md", method_page(name, cls))
    for slug, text in results_pages(docs / "results").items():
        write(docs / "results" / f"{slug}.md", text)


def copy_plotly(app: Any) -> None:
    """plotly.js beside the pages, so that the results' figures work offline."""
    import plotly

    source = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    static = Path(app.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, static / "plotly.min.js")


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", lambda app: (generate(Path(app.srcdir)), copy_plotly(app)))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
